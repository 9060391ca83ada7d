"""Reasoning (grammar/tooling/reasoning.py): where the output starts (the prompt's end), the split into
reasoning and content (whole, or in any split), the grammar that constrains only what follows
`</think>`, and the budget that forces the close tag after exactly `max_tokens` tokens, with
the close tag as text or as one token."""

from __future__ import annotations

import json
import random
import shutil

import jsonschema
import pytest
import torch
from tokenizers import AddedToken
from transformers import AutoTokenizer

from loraplex.grammar.backend import GrammarError, StructuredOutputs
from loraplex.grammar.manager import GrammarManager
from loraplex.grammar.tooling.reasoning import CLOSE, Reasoning, ReasoningGate, ReasoningSplitter, prompt_start, split_reasoning
from loraplex.grammar.tooling.tools import Function, ToolCalls, parse_tool_calls

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["n"],
          "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}}
QWEN, R1 = Reasoning("qwen3"), Reasoning("deepseek_r1")
INSIDE = Reasoning("qwen3", start="inside")


@pytest.mark.parametrize("reasoning,text,split", [
    (QWEN, "<think>\nhmm</think>\n\nHello", ("\nhmm", "Hello")),
    (QWEN, "Hello <think>no</think>", ("", "Hello <think>no</think>")),  # qwen3 reasons only when it opens
    (R1, "hmm</think>Hello", ("hmm", "Hello")),  # deepseek_r1 starts inside
    (R1, "<think>hmm</think> Hello", ("hmm", "Hello")),
    (R1, "hmm, still thinking", ("hmm, still thinking", "")),  # cut off: still reasoning
    (INSIDE, "a</think>b</think>c", ("a", "b</think>c")),  # the first close tag ends it
    (Reasoning("qwen3", start="closed"), "<think>x</think>y", ("", "<think>x</think>y")),
])
def test_the_split_whole_and_in_any_split(reasoning, text, split):
    assert split_reasoning(reasoning, text) == split
    for seed in range(5):
        rng, splitter, got, i = random.Random(seed), ReasoningSplitter(reasoning), ["", ""], 0
        while i <= len(text):
            step = rng.randint(1, 4)
            pieces = splitter.feed(text[i:i + step], final=i + step >= len(text))
            got = [got[0] + pieces[0], got[1] + pieces[1]]
            i += step
        assert tuple(got) == split


def test_the_prompts_end_says_where_the_output_starts():
    assert prompt_start("<|im_start|>assistant\n<think>\n") == "inside"
    assert prompt_start("assistant\n<think>\n\n</think>\n\n") == "closed"
    assert prompt_start("<think>a</think>answer<|im_end|>\n<|im_start|>assistant\n") == "fresh"
    with pytest.raises(ValueError, match="max_reasoning_tokens"):
        Reasoning("qwen3", -1)
    with pytest.raises(ValueError, match="reasoning parser"):
        Reasoning("o1")


@pytest.fixture(scope="module", params=["text", "token"])
def mgr(request, tiny_model_dir, tmp_path_factory):
    """The close tag spelled out in text, and as one added token (as Qwen3's tokenizer has it)."""
    folder = tiny_model_dir
    if request.param == "token":
        folder = tmp_path_factory.mktemp("think-tokens")
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tiny_model_dir / name, folder / name)
        tok = AutoTokenizer.from_pretrained(folder)
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
        tok.save_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    return GrammarManager(tok, vocab_size=448, stop_token_ids=[tok.eos_token_id], backend="auto"), tok


def run(manager, tok, spec, seed: int, max_steps: int = 200, shy: bool = True) -> tuple[list[int], bool]:
    """Random logits through the mask; `shy`: the close tag's tokens are unlikely (so only the
    budget closes the reasoning). The tokens, and whether the grammar ended."""
    grammar = manager.new_grammar(manager.compile(spec))
    g, out = torch.Generator().manual_seed(seed), []
    for _ in range(max_steps):
        logits = torch.randn(1, 448, generator=g) * 3
        logits[0, tok.eos_token_id] -= 4  # free text goes on for a while
        if shy:
            logits[0, manager.close_ids] -= 30
        manager.apply(logits, [grammar])
        token = int(torch.multinomial(torch.softmax(logits[0], -1), 1, generator=g))
        assert grammar.accept_token(token)
        if grammar.is_terminated():
            return out, True
        out.append(token)
    return out, False


def close_at(manager, tok, tokens: list[int]) -> int:
    """Tokens before the close tag."""
    for n in range(len(tokens)):
        if tok.decode(tokens[:n + len(manager.close_ids)]).endswith(CLOSE):
            return n
    raise AssertionError(f"no close tag in {tok.decode(tokens)!r}")


@pytest.mark.parametrize("budget", [0, 3, 12])
@pytest.mark.parametrize("reasoning", [INSIDE, R1], ids=["inside", "deepseek_r1"])
def test_the_budget_forces_the_close_tag_then_the_schema_holds(mgr, budget, reasoning):
    manager, tok = mgr
    spec = StructuredOutputs(json=SCHEMA, reasoning=Reasoning(reasoning.parser, budget, reasoning.start))
    tokens, ended = run(manager, tok, spec, seed=budget)
    assert ended
    assert close_at(manager, tok, tokens) == budget
    _, content = split_reasoning(spec.reasoning, tok.decode(tokens))
    jsonschema.validate(json.loads(content), SCHEMA)
    assert manager.compile(spec).violation(content) is None


@pytest.mark.parametrize("seed", range(3))
def test_tool_calls_and_choices_come_after_the_reasoning(mgr, seed):
    manager, tok = mgr
    budget = Reasoning("qwen3", 6, "inside")
    calls = ToolCalls((Function("count", SCHEMA),), required=True, parallel=False, format="pythonic")
    tokens, ended = run(manager, tok, StructuredOutputs(tools=calls, reasoning=budget), seed)
    _, content = split_reasoning(budget, tok.decode(tokens))
    assert ended and parse_tool_calls(content, "pythonic")[1][0].name == "count"
    tokens, ended = run(manager, tok, StructuredOutputs(choice=["yes", "no"], reasoning=budget), seed)
    assert ended and split_reasoning(budget, tok.decode(tokens))[1] in ("yes", "no")


def test_qwen3_may_answer_without_reasoning(mgr):
    manager, tok = mgr
    spec = StructuredOutputs(choice=["yes", "no"], reasoning=Reasoning("qwen3", 4))
    grammar = manager.new_grammar(manager.compile(spec))
    for token in tok.encode("yes", add_special_tokens=False):
        assert grammar.accept_token(token)
    assert not grammar.thinking and grammar.accept_token(tok.eos_token_id)


def test_the_free_reasoning_is_never_steered_and_rollback_restores_the_budget(mgr):
    manager, tok = mgr
    spec = StructuredOutputs(json=SCHEMA, reasoning=Reasoning("qwen3", 2, "inside"))
    gate = manager.new_grammar(manager.compile(spec))
    assert isinstance(gate, ReasoningGate)
    logits = torch.zeros(1, 448)
    manager.apply(logits, [gate], closing=[True])  # near max_tokens: JSON steers to closers, thought does not
    assert torch.isfinite(logits).sum() > 100
    word = tok.encode("hello", add_special_tokens=False)
    for token in word[:2]:
        assert gate.accept_token(token)
    assert gate.forcing
    gate.rollback(1)
    assert not gate.forcing and gate.num_tokens == 1 and gate.thinking
    assert gate.accept_token(word[1])
    logits = torch.zeros(1, 448)
    manager.apply(logits, [gate])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == manager.close_ids[:1]


def test_a_character_split_across_tokens_is_finished_before_the_close_tag(mgr):
    manager, tok = mgr
    gate = manager.new_grammar(manager.compile(StructuredOutputs(json=SCHEMA, reasoning=Reasoning("qwen3", 1,
                                                                                                  "inside"))))
    first, *rest = tok.encode("日", add_special_tokens=False)
    if not rest:
        pytest.skip("the tokenizer holds the character in one token")
    assert gate.accept_token(first) and gate.forcing
    logits = torch.zeros(1, 448)
    manager.apply(logits, [gate])
    assert torch.isfinite(logits[0, rest[0]]) and not torch.isfinite(logits[0, manager.close_ids[0]])
    assert gate.accept_token(rest[0])  # the character is whole: now only the close tag
    logits = torch.zeros(1, 448)
    manager.apply(logits, [gate])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == manager.close_ids[:1]


def test_only_llguidance_writes_the_grammar_after_reasoning(mgr):
    manager, tok = mgr
    xgrammar = GrammarManager(tok, 448, [tok.eos_token_id], backend="xgrammar")
    with pytest.raises(GrammarError, match="need the llguidance grammar backend"):
        xgrammar.compile(StructuredOutputs(json=SCHEMA, reasoning=INSIDE))
    with pytest.raises(GrammarError, match="exactly one of"):
        StructuredOutputs()
    assert StructuredOutputs(reasoning=INSIDE).kind == "text"
