"""The outlines backend on its own, and `auto` routing what only outlines compiles; both write
one shared bitmask."""

import json
import re

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from loraplex.grammar.backend import GrammarError, StructuredOutputs
from loraplex.grammar.manager import GrammarManager
from loraplex.platform import LLM, SamplingParams
from test_grammar import walk

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "tags", "kind"],
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 5},
                         "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 1, "maxItems": 2},
                         "kind": {"const": "a"}, "ok": {"type": "boolean"}}}


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def manager(tok, backend):
    return GrammarManager(tok, vocab_size=448, stop_token_ids=[tok.eos_token_id], backend=backend)


@pytest.mark.parametrize("seed", range(3))
def test_outlines_walks_end_in_valid_output(tok, seed):
    mgr = manager(tok, "outlines")
    jsonschema.validate(json.loads(walk(mgr, tok, StructuredOutputs(json=SCHEMA), seed)), SCHEMA)
    assert re.fullmatch(r"[a-c]{2,4}-\d\d", walk(mgr, tok, StructuredOutputs(regex=r"[a-c]{2,4}-\d\d"), seed))
    assert walk(mgr, tok, StructuredOutputs(choice=["yes", "no way", "a.b"]), seed) in ("yes", "no way", "a.b")


def test_outlines_refuses_what_it_would_not_enforce(tok):
    mgr = manager(tok, "outlines")
    with pytest.raises(GrammarError, match="'maximum' at #/properties/n is not supported by the outlines"):
        mgr.compile(StructuredOutputs(json={"type": "object", "properties": {"n": {"type": "integer", "maximum": 3}}}))
    with pytest.raises(GrammarError, match="'format: date-time' at #/properties/t .*outlines"):
        mgr.compile(StructuredOutputs(json={"type": "object", "properties": {"t": {"type": "string",
                                                                                  "format": "date-time"}}}))
    for spec in (StructuredOutputs(json_object=True), StructuredOutputs(grammar='root ::= "a"')):
        with pytest.raises(GrammarError, match="not supported by the outlines backend"):
            mgr.compile(spec)
    with pytest.raises(GrammarError, match="invalid regex"):
        mgr.compile(StructuredOutputs(regex="a(b"))


def test_rollback_and_termination(tok):
    mgr = manager(tok, "outlines")
    g = mgr.new_grammar(mgr.compile(StructuredOutputs(regex="ab")))
    a, b = tok.convert_tokens_to_ids("a"), tok.convert_tokens_to_ids("b")
    assert not g.accept_token(b)
    assert g.accept_token(a) and g.accept_token(b) and not g.is_terminated()
    assert g.accept_token(tok.eos_token_id) and g.is_terminated()
    g.rollback(2)
    assert not g.is_terminated() and g.accept_token(b)


def test_auto_routes_each_spec_to_the_first_backend_that_enforces_it(tok, monkeypatch):
    auto = manager(tok, "auto")
    for regex in (r"\p{Lu}[a-z]{1,3}", r"(?i)ab"):
        with pytest.raises(GrammarError):
            manager(tok, "xgrammar").compile(StructuredOutputs(regex=regex))
        assert auto.compile(StructuredOutputs(regex=regex)).backend == "llguidance"
        assert re.fullmatch(regex.replace(r"\p{Lu}", "[A-Z]"), walk(auto, tok, StructuredOutputs(regex=regex), 0))
    # multipleOf: xgrammar would ignore it (refused), llguidance enforces it (the oracle says so)
    with pytest.raises(GrammarError, match="'multipleOf'.*xgrammar"):
        manager(tok, "xgrammar").compile(StructuredOutputs(json={"type": "integer", "multipleOf": 3}))
    assert auto.compile(StructuredOutputs(json={"type": "integer", "multipleOf": 3})).backend == "llguidance"
    with pytest.raises(GrammarError, match="'not'.*llguidance"):  # refused by all: the first one's reason
        auto.compile(StructuredOutputs(json={"type": "object", "properties": {"a": {"not": {"pattern": "^x"}}}}))
    # a spec the first backend fails goes on to the next, down to outlines
    llguidance, xgrammar = auto._get("llguidance"), auto._get("xgrammar")
    monkeypatch.setattr(llguidance, "compile", lambda spec: (_ for _ in ()).throw(GrammarError("no")))
    assert auto.compile(StructuredOutputs(regex="x+")).backend == "xgrammar"
    monkeypatch.setattr(xgrammar, "compile", lambda spec: (_ for _ in ()).throw(GrammarError("no")))
    regex = r"\p{Lu}[a-z]{1,4}"  # not compiled above: finished compiles are kept by spec
    assert auto.compile(StructuredOutputs(regex=regex)).backend == "outlines"
    assert re.fullmatch("[A-Z][a-z]{1,4}", walk(auto, tok, StructuredOutputs(regex=regex), 0))


def test_engine_with_both_backends_in_one_batch(tiny_model_dir):
    import jsonschema

    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, grammar_backend="auto")
    prompts = [{"prompt_token_ids": [3, 4, 5]}, {"prompt_token_ids": [6, 7]}, {"prompt_token_ids": [8]}]
    params = [SamplingParams(temperature=1.0, seed=1, n=2, max_tokens=60, structured=StructuredOutputs(json=SCHEMA)),
              SamplingParams(temperature=1.0, seed=2, max_tokens=20, structured=StructuredOutputs(regex=r"(?i)ab{1,3}!")),
              SamplingParams(temperature=1.0, seed=3, max_tokens=20, structured=StructuredOutputs(choice=["p", "q"]))]
    outs = llm.generate(prompts, params)
    for c in outs[0].outputs:
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert re.fullmatch(r"(?i)ab{1,3}!", outs[1].outputs[0].text) and outs[1].outputs[0].finish_reason == "stop"
    assert outs[2].outputs[0].text in ("p", "q")
    only = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, grammar_backend="outlines")
    out = only.generate([prompts[0]], SamplingParams(temperature=0.8, seed=4, max_tokens=200,
                                                     structured=StructuredOutputs(json=SCHEMA)))[0].outputs[0]
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), SCHEMA)


OUTLINES_E2E = {
    "nested": {"type": "object", "additionalProperties": False, "required": ["user", "tags"],
               "properties": {"user": {"type": "object", "additionalProperties": False, "required": ["name"],
                                       "properties": {"name": {"type": "string", "minLength": 2, "maxLength": 12}}},
                              "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                       "minItems": 1, "maxItems": 3}}},
    "enum-const-anyof": {"type": "object", "additionalProperties": False, "required": ["kind", "v", "x"],
                         "properties": {"kind": {"enum": ["cat", "dog"]}, "v": {"const": 2},
                                        "x": {"anyOf": [{"type": "boolean"}, {"type": "null"}]}}},
    "pattern-format": {"type": "object", "additionalProperties": False, "required": ["code", "day"],
                       "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                                      "day": {"type": "string", "format": "date"}}},
}


@pytest.mark.e2e
def test_outlines_on_the_default_model(default_model_dir):
    llm = LLM(str(default_model_dir), dtype="float32", max_model_len=512, num_kv_blocks=256,
              grammar_backend="outlines")
    tok = llm.get_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": "Reply with a JSON object describing a person."}],
                                     tokenize=False, add_generation_prompt=True)
    cases = [(name, seed) for name in OUTLINES_E2E for seed in range(2)]
    outs = llm.generate([prompt] * len(cases), [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=150, structured=StructuredOutputs(json=OUTLINES_E2E[n]))
        for n, seed in cases])
    for (name, _), out in zip(cases, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (name, c.text)
        jsonschema.validate(json.loads(c.text), OUTLINES_E2E[name], format_checker=jsonschema.FormatChecker())
    regex = llm.generate([prompt] * 2, [SamplingParams(temperature=1.0, seed=s, max_tokens=20,
                                                       structured=StructuredOutputs(regex=r"\p{Lu}\p{Ll}{2,8} [0-9]{2}"))
                                        for s in range(2)])
    assert all(re.fullmatch(r"[A-Z][a-z]{2,8} [0-9]{2}", o.outputs[0].text) for o in regex)


def test_a_backend_that_cannot_load_is_passed_over_by_auto(tok, monkeypatch):
    import loraplex.grammar.backends.llguidance_backend as llg

    def unavailable(*args, **kwargs):
        raise ValueError("Only fast tokenizers are supported")

    monkeypatch.setattr(llg, "LLGuidanceBackend", unavailable)
    auto = manager(tok, "auto")
    assert auto.compile(StructuredOutputs(regex="x+")).backend == "xgrammar"
    with pytest.raises(GrammarError, match="llguidance grammar backend cannot serve this model's tokenizer"):
        manager(tok, "llguidance").compile(StructuredOutputs(regex="x+"))
