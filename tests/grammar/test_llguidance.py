"""The llguidance backend on its own: every spec kind, stop tokens, rollback, jump-forward, its
refusals by name; and in the engine beside the other backends."""

import json
import re

import jsonschema
import pytest
from transformers import AutoTokenizer

from loraplex.grammar.backend import GrammarError, StructuredOutputs
from loraplex.grammar.schema.json_schema import UnsupportedKeywordError
from loraplex.grammar.manager import GrammarManager
from loraplex.platform import LLM, SamplingParams
from test_grammar import EBNF, SCHEMA, walk


@pytest.fixture(scope="module")
def mgr(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return GrammarManager(tok, vocab_size=448, stop_token_ids=[tok.eos_token_id], backend="llguidance"), tok


@pytest.mark.parametrize("seed", range(3))
def test_walks_end_in_output_the_spec_allows(mgr, seed):
    manager, tok = mgr
    jsonschema.validate(json.loads(walk(manager, tok, StructuredOutputs(json=SCHEMA), seed)), SCHEMA)
    assert isinstance(json.loads(walk(manager, tok, StructuredOutputs(json_object=True), seed, 600)), dict)
    assert re.fullmatch(r"[a-c]{2,4}-\d\d", walk(manager, tok, StructuredOutputs(regex=r"[a-c]{2,4}-\d\d"), seed))
    choices = ["yes", 'say "hi"', "back\\slash", "ok 😀"]
    assert walk(manager, tok, StructuredOutputs(choice=choices), seed) in choices
    expr = walk(manager, tok, StructuredOutputs(grammar=EBNF), seed)  # EBNF (GBNF dialect), converted to Lark
    assert re.fullmatch(r"[1-9()+*]+", expr) and expr.count("(") == expr.count(")")
    lark = walk(manager, tok, StructuredOutputs(grammar='start: "x" NUM\nNUM: /[0-9]{2}/'), seed)
    assert re.fullmatch(r"x[0-9]{2}", lark)


def test_stop_token_rollback_and_jump_forward(mgr):
    manager, tok = mgr
    grammar = manager.new_grammar(manager.compile(StructuredOutputs(json={
        "type": "object", "additionalProperties": False, "required": ["k"], "properties": {"k": {"const": "v"}}})))
    assert grammar.jump_forward_string() == '{"k":"v"}'  # all of it is forced
    ids = tok.encode('{"k":"v"}', add_special_tokens=False)
    assert not grammar.accept_token(tok.eos_token_id)  # not before the object is complete
    assert all(grammar.accept_token(t) for t in ids) and not grammar.is_terminated()
    assert grammar.accept_token(tok.eos_token_id) and grammar.is_terminated()
    assert not grammar.accept_token(ids[0])  # nothing after the end
    grammar.rollback(2)  # the stop token and the last token
    assert not grammar.is_terminated() and grammar.jump_forward_string() == tok.decode(ids[-1:])
    assert grammar.accept_token(ids[-1]) and grammar.accept_token(tok.eos_token_id)


def test_refusals_name_the_keyword_and_where(mgr):
    manager, _ = mgr
    cases = [({"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}},
              "'uniqueItems' at #/properties/a"),
             ({"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3, "pattern": "[a-z]"}]}, "'oneOf' at #"),
             ({"type": "array", "contains": {"type": "integer"}}, "'contains' at #")]
    for schema, message in cases:
        with pytest.raises(UnsupportedKeywordError, match=re.escape(message) + ".*llguidance"):
            manager.compile(StructuredOutputs(json=schema))
    with pytest.raises(UnsupportedKeywordError, match="'format: no-such-format' at # is not one of the formats "
                                                      "OpenAI's strict mode supports"):
        manager.compile(StructuredOutputs(json={"type": "string", "format": "no-such-format"}, openai_strict=True))
    for spec, message in [(StructuredOutputs(regex="a(b"), "invalid regex"),
                          (StructuredOutputs(grammar='root ::= "a" | ('), "invalid grammar"),
                          (StructuredOutputs(json={"$ref": "#/$defs/missing"}), "invalid json")]:
        with pytest.raises(GrammarError, match=message):
            manager.compile(spec)


def test_compiles_are_cached_and_matchers_independent(mgr):
    manager, tok = mgr
    spec = StructuredOutputs(regex="ab|ac")
    first, second = manager.compile(spec), manager.compile(spec)
    assert first.grammar is second.grammar
    a, b = manager.new_grammar(first), manager.new_grammar(second)
    assert a.accept_token(tok.convert_tokens_to_ids("a")) and a.accept_token(tok.convert_tokens_to_ids("b"))
    assert b.jump_forward_string() == "a"  # b is still at the start


def test_engine_batches_llguidance_and_xgrammar_grammars_together(tiny_model_dir, monkeypatch):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, grammar_backend="auto",
              grammar_compile_workers=0)  # in this process: the patched backend is the one that compiles
    grammars = llm.engine.grammars
    real = grammars._get("llguidance").compile
    # regexes go to xgrammar here, everything else stays with llguidance: both in one step's mask
    monkeypatch.setattr(grammars._get("llguidance"), "compile",
                        lambda spec: (_ for _ in ()).throw(GrammarError("no")) if spec.kind == "regex" else real(spec))
    prompts = [{"prompt_token_ids": [3, 4, 5]}, {"prompt_token_ids": [6, 7]}]
    params = [SamplingParams(temperature=1.0, seed=1, n=2, max_tokens=80, structured=StructuredOutputs(json=SCHEMA)),
              SamplingParams(temperature=1.0, seed=2, max_tokens=20, structured=StructuredOutputs(regex="ab{1,3}!"))]
    outs = llm.generate(prompts, params)
    for c in outs[0].outputs:
        assert c.finish_reason == "stop" and c.schema_violation is None
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert re.fullmatch("ab{1,3}!", outs[1].outputs[0].text)
