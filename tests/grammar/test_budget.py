"""Valid inside max_tokens (grammar/budget.py): the planner's shortest completions, the guard's promise under
random picks, the refusal of a budget too small, and outputs through the engine that end valid at their budget."""

import json

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from loraplex.grammar.backend import StructuredOutputs
from loraplex.grammar.budget import hint_texts, regex_example
from loraplex.grammar.manager import GrammarManager
from loraplex.platform import LLM, SamplingParams

NESTED = {"type": "object", "additionalProperties": False, "required": ["user", "tags"],
          "properties": {"user": {"type": "object", "required": ["name", "email"],
                                  "properties": {"name": {"type": "string", "minLength": 2},
                                                 "email": {"type": "string", "format": "email"}}},
                         "tags": {"type": "array", "minItems": 2, "items": {"enum": ["red", "green"]}},
                         "note": {"type": "string"}}}
SCHEMAS = [
    NESTED,
    {"type": "object", "required": ["when", "code"], "properties": {
        "when": {"type": "string", "pattern": "\\d{4}-\\d{2}T\\d{2}.\\d{3}"},  # unanchored: any text around it
        "code": {"type": "string", "pattern": "^[A-Z]{3}#[0-9]+$"}}},
    {"type": "array", "minItems": 1, "items": {"type": "object", "required": ["id"],
                                               "properties": {"id": {"type": "integer", "minimum": 100}}}},
    {"type": "string", "format": "date-time"},
]


@pytest.fixture(scope="module")
def manager(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return GrammarManager(tok, 448, [tok.eos_token_id], backend="llguidance", within_budget=True), tok


def test_plans_are_the_shortest_answers_and_valid(manager):
    mgr, tok = manager
    cases = [({"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}, "b": {}}}, '{"a":0}'),
             ({"type": "object", "properties": {"x": {"type": "object"}}}, "{}"),
             ({"type": "array", "minItems": 2, "items": {"enum": ["red", "green"]}}, '["red","red"]'),
             ({"type": "string", "pattern": "^x{3}$"}, '"xxx"')]
    for schema, shortest in cases:
        compiled = mgr.compile(StructuredOutputs(json=schema))
        assert tok.decode(list(compiled.budget_plan[0])) == shortest
        assert mgr.shortest(compiled) == len(tok.encode(shortest, add_special_tokens=False))
    for schema in SCHEMAS:  # patterns and formats a byte at a time never meet: hints do
        compiled = mgr.compile(StructuredOutputs(json=schema))
        text = tok.decode(list(compiled.budget_plan[0]))
        jsonschema.validate(json.loads(text), schema)


def test_off_for_other_backends_and_the_setting(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    spec = StructuredOutputs(json=NESTED)
    off = GrammarManager(tok, 448, [tok.eos_token_id], backend="llguidance")
    xgr = GrammarManager(tok, 448, [tok.eos_token_id], backend="xgrammar", within_budget=True)
    for mgr in (off, xgr):
        compiled = mgr.compile(spec)
        assert mgr.shortest(compiled) is None and mgr.new_grammar(compiled).guard is None


@pytest.mark.parametrize("slack", [0, 1, 5])
def test_random_picks_always_end_valid_inside_the_budget(manager, slack):
    """Whatever the sampler draws, the guard takes back what would not fit: at `shortest + slack` tokens every
    output is complete (random logits stand in for a model that never wants to close)."""
    mgr, tok = manager
    for k, schema in enumerate(SCHEMAS):
        compiled = mgr.compile(StructuredOutputs(json=schema))
        budget = mgr.shortest(compiled) + slack
        for seed in range(2):
            g, grammar, out = torch.Generator().manual_seed(seed * 10 + k), mgr.new_grammar(compiled), []
            for left in range(budget, 0, -1):
                logits = torch.randn(1, 448, generator=g) * 3
                mgr.apply(logits, [grammar])
                token = int(torch.multinomial(torch.softmax(logits[0], -1), 1, generator=g))
                if not grammar.guard.fits((token,), left):
                    token = grammar.guard.fallback()
                assert grammar.accept_token(token)
                if grammar.is_terminated():
                    break
                out.append(token)
            assert grammar.terminated or grammar.matcher.is_accepting(), (schema, tok.decode(out))
            jsonschema.validate(json.loads(tok.decode(out)), schema)


def test_a_rollback_restores_the_plan(manager):
    """A dry run (the drafter's) takes tokens and gives them back: the plan known before is known again."""
    mgr, _ = manager
    grammar = mgr.new_grammar(mgr.compile(StructuredOutputs(json=NESTED)))
    before = grammar.guard.current()
    assert grammar.accept_token(before[0]) and grammar.accept_token(before[1])
    assert grammar.guard.current() == before[2:]
    grammar.rollback(2)
    assert grammar.guard.current() is before


def test_hints_and_regex_examples():
    assert regex_example("^[0-9]+#[A-Za-z0-9]+") == "0#A"
    assert regex_example("\\d{2}-(ab|c)x?$") == "00-c"
    assert regex_example("a{100000}") is None and regex_example("(unclosed") is None
    spec = StructuredOutputs(json={"properties": {"a": {"enum": ["x y", 3]}, "b": {"format": "email"},
                                                  "c": {"pattern": "request"}}})
    assert {"x y", "3", "a@a.aa", "request"} <= set(hint_texts(spec))


def test_a_budget_too_small_is_refused_naming_the_minimum(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=32)
    need = llm.engine.grammars.shortest(llm.engine.grammars.compile(StructuredOutputs(json=NESTED)))
    params = SamplingParams(max_tokens=need - 1, structured=StructuredOutputs(json=NESTED))
    with pytest.raises(ValueError, match=f"max_tokens={need - 1} is too few .* takes {need} tokens"):
        llm.generate([{"prompt_token_ids": [3, 4]}], params)
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("speculative", [None, '{"method": "grammar", "num_speculative_tokens": 4}'])
def test_engine_outputs_end_valid_at_their_budget(tiny_model_dir, speculative):
    """Random weights ramble inside strings; with no closing steer at all (json_close_window 0) every output still
    ends complete and valid at max_tokens = the shortest answer + a little, finish_reason stop."""
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, json_close_window=0,
              speculative_config=speculative)
    need = llm.engine.grammars.shortest(llm.engine.grammars.compile(StructuredOutputs(json=NESTED)))
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=need + slack, logprobs=1,
                             structured=StructuredOutputs(json=NESTED)) for seed, slack in enumerate((0, 3, 9, 20))]
    for out in llm.generate([{"prompt_token_ids": [3, 4, 5]}] * len(params), params):
        c = out.outputs[0]
        assert c.finish_reason == "stop" and c.schema_violation is None, c.text
        jsonschema.validate(json.loads(c.text), NESTED)
        assert len(c.logprobs) == len(c.token_ids) and all(t in lp for t, lp in zip(c.token_ids, c.logprobs))


def test_a_token_fits_only_where_a_completion_after_it_is_known_to_fit(manager):
    """An optional array of 300 items: opening it fits a roomy budget (its plan is found, a long one) and not a
    small one; an optional string of 3,000 characters does not fit 1,100 tokens though the start plan is `{}`."""
    mgr, tok = manager
    schema = {"type": "object", "additionalProperties": False,
              "properties": {"tags": {"type": "array", "minItems": 300, "items": {"enum": ["alpha", "beta"]}}}}
    grammar = mgr.new_grammar(mgr.compile(StructuredOutputs(json=schema)))
    key = tuple(tok.encode('{"tags"', add_special_tokens=False))
    assert not grammar.guard.fits(key, 50) and grammar.guard._pending is None
    assert grammar.guard.fits(key, 100_000) and len(grammar.guard._pending[1]) > 300
    schema = {"type": "object", "additionalProperties": False, "properties": {"a": {"type": "string", "minLength": 3000}}}
    compiled = mgr.compile(StructuredOutputs(json=schema))
    grammar, key = mgr.new_grammar(compiled), tuple(tok.encode('{"a"', add_special_tokens=False))
    assert mgr.shortest(compiled) == len(tok.encode("{}", add_special_tokens=False))
    assert not grammar.guard.fits(key, 1100)


def test_a_failing_guard_is_dropped_not_raised(manager):
    from loraplex.grammar.budget import guarded

    mgr, _ = manager
    grammar = mgr.new_grammar(mgr.compile(StructuredOutputs(json=NESTED)))

    def broken(guard):
        raise RuntimeError("a bug in the guard")

    assert guarded(grammar, broken, "otherwise", "req-1") == "otherwise" and grammar.guard is None
    assert guarded(grammar, lambda guard: pytest.fail("no guard left to call"), 7) == 7


def test_a_pattern_is_never_run_to_find_its_hint(monkeypatch):
    """A client's pattern may backtrack for minutes in Python's `re`: its hint is built from the parse alone."""
    import re

    monkeypatch.setattr(re, "search", lambda *a: pytest.fail("the pattern was run"))
    monkeypatch.setattr(re, "match", lambda *a: pytest.fail("the pattern was run"))
    assert regex_example("(a?){34}a{34}b") == "a" * 34 + "b"


def test_planning_never_moves_the_start_state_others_copy(manager):
    """The start matcher of a compile is copied for each new sequence while another thread may plan on it: the
    planner only ever copies it (a dry run on it, rolled back, would still be seen by a copy taken meanwhile)."""
    mgr, _ = manager
    compiled = mgr.compile(StructuredOutputs(json=SCHEMAS[1]))

    class CopyOnly:
        def __init__(self, matcher):
            self.matcher = matcher

        def deep_copy(self):
            return self.matcher.deep_copy()

    plan = mgr._get("llguidance").planner.plan(CopyOnly(compiled.grammar), compiled.budget_plan[1])
    assert plan == compiled.budget_plan[0]


def test_an_output_that_may_go_on_is_still_cut_off(tiny_model_dir):
    """`stop` at max_tokens only where the grammar allows nothing more: a regex that may go on reports `length`."""
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=32)
    out = llm.generate([{"prompt_token_ids": [3, 4]}], SamplingParams(
        temperature=1.0, seed=0, max_tokens=6, structured=StructuredOutputs(regex="[a-z ]+")))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 6
