"""Structured outputs through the engine: tiny model for the mechanics, the default model for
real schemas sampled at temperature 1."""

import json
import re
from functools import reduce

import pytest

from conftest import assert_all_blocks_free
from loraplex.grammar.backend import GrammarError
from loraplex.platform import LLM, SamplingParams, StructuredOutputs
from loraplex.platform.engine.output_processor import accumulate

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "n"],
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 6},
                         "n": {"type": "integer", "minimum": 0, "maximum": 9}}}


def structured(seed, n=1, max_tokens=60, **spec):
    return SamplingParams(temperature=1.0, seed=seed, n=n, max_tokens=max_tokens, structured=StructuredOutputs(**spec))


def test_n_preemption_and_mixed_batch(tiny_model_dir):
    import jsonschema

    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=10, max_num_batched_tokens=32)
    prompts = [{"prompt_token_ids": list(range(3, 3 + k))} for k in (5, 30, 12, 50)]
    params = [structured(1, n=3, json=SCHEMA), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              structured(2, regex=r"(ab|cd){2,3}!"), structured(3, choice=["alpha", "beta"])]
    outs = llm.generate(prompts, params)
    assert llm.engine.core.scheduler.num_preemptions > 0
    for c in outs[0].outputs:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert len(outs[1].outputs[0].token_ids) == 20
    assert re.fullmatch(r"(ab|cd){2,3}!", outs[2].outputs[0].text)
    assert outs[3].outputs[0].text in ("alpha", "beta")
    assert_all_blocks_free(llm.engine)


def test_truncation_is_reported_as_length(tiny_model_dir):
    """Without the budget guarantee (grammar/budget.py) a structured output can be cut off: reported as such."""
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=32, finish_within_budget=False)
    out = llm.generate([{"prompt_token_ids": [3, 4]}], structured(0, max_tokens=3, json=SCHEMA))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3 and out.text.startswith("{")


@pytest.mark.parametrize("spec,message", [
    (dict(json={"type": "object", "properties": {"a": {"not": {"pattern": "^x"}}}}), "'not'"),
    (dict(regex="(unclosed"), "invalid regex"),
    (dict(grammar="root ::= missing_rule"), "invalid grammar"),
])
def test_bad_specs_fail_before_any_token_and_others_go_on(tiny_model_dir, spec, message):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=32)
    good = {"prompt_token_ids": [3, 4, 5]}
    with pytest.raises(GrammarError, match=message):
        llm.generate([good, good], [SamplingParams(max_tokens=4), structured(0, **spec)])
    assert not llm.engine.has_unfinished()
    assert len(llm.generate([good], SamplingParams(max_tokens=4, ignore_eos=True))[0].outputs[0].token_ids) == 4


E2E_SCHEMAS = {
    "nested": {"type": "object", "additionalProperties": False, "required": ["user", "tags"],
               "properties": {"user": {"type": "object", "additionalProperties": False, "required": ["name", "age"],
                                       "properties": {"name": {"type": "string", "minLength": 2, "maxLength": 12},
                                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}}},
                              "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                       "minItems": 1, "maxItems": 3}}},
    "enum-const-anyof": {"type": "object", "additionalProperties": False, "required": ["kind", "v", "x"],
                         "properties": {"kind": {"enum": ["cat", "dog"]}, "v": {"const": 2},
                                        "x": {"anyOf": [{"type": "boolean"}, {"type": "number", "minimum": -1, "maximum": 1}]}}},
    "ref-recursive": {"$defs": {"node": {"type": "object", "additionalProperties": False, "required": ["id"],
                                         "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9},
                                                        "child": {"$ref": "#/$defs/node"}}}},
                      "$ref": "#/$defs/node"},
    "pattern-format": {"type": "object", "additionalProperties": False, "required": ["code", "day"],
                       "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                                      "day": {"type": "string", "format": "date"}}},
}


@pytest.mark.e2e
def test_default_model_samples_validate(default_model_dir):
    import jsonschema

    llm = LLM(str(default_model_dir), dtype="float32", max_model_len=512, num_kv_blocks=256)
    tok = llm.get_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": "Reply with a JSON object describing a person."}],
                                     tokenize=False, add_generation_prompt=True)
    cases = [(name, seed) for name in E2E_SCHEMAS for seed in range(2)]
    params = [structured(seed, max_tokens=100, json=E2E_SCHEMAS[name]) for name, seed in cases]
    outs = llm.generate([prompt] * len(cases), params)
    for (name, _), out in zip(cases, outs):
        c = out.outputs[0]
        if name == "ref-recursive" and c.finish_reason == "length":
            assert re.match(r'\{"id": ?', c.text)  # recursion has no depth bound: the model may nest on
            continue
        assert c.finish_reason == "stop", (name, c.text)  # bounded schemas end well inside max_tokens
        jsonschema.validate(json.loads(c.text), E2E_SCHEMAS[name], format_checker=jsonschema.FormatChecker())
    regex = llm.generate([prompt] * 3, [structured(s, max_tokens=20, regex=r"[A-Z][a-z]{2,8} [0-9]{2}") for s in range(3)])
    assert all(re.fullmatch(r"[A-Z][a-z]{2,8} [0-9]{2}", o.outputs[0].text) for o in regex)
    choice = llm.generate([prompt] * 3, [structured(s, choice=["red", "green", "blue"]) for s in range(3)])
    assert all(o.outputs[0].text in ("red", "green", "blue") for o in choice)
    assert_all_blocks_free(llm.engine)


def test_structured_and_lora_requests_share_a_batch(tiny_model_dir, tiny_adapters):
    import jsonschema

    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, lora_modules={"a": str(tiny_adapters[0])})
    prompts = [{"prompt_token_ids": [3, 4, 5, 6]}] * 3
    params = [structured(5, json=SCHEMA), structured(6, json=SCHEMA), SamplingParams(max_tokens=5, ignore_eos=True)]
    outs = llm.generate(prompts, params, adapter=["a", None, "a"])
    for out in outs[:2]:
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
    assert len(outs[2].outputs[0].token_ids) == 5
    assert llm.engine.adapters.num_pins() == 0


def test_slow_compile_never_stalls_other_requests(tiny_model_dir, monkeypatch):
    """The compile runs in the submitting thread (against the pool): while one is stuck, the
    engine thread keeps stepping other requests to completion."""
    import threading

    from loraplex.platform.engine.async_engine import AsyncEngine

    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, grammar_backend="xgrammar",
              grammar_compile_workers=0)  # in this process: the patched backend is the one that compiles
    backend = llm.engine.grammars._get("xgrammar")
    real = backend.compile
    release = threading.Event()
    monkeypatch.setattr(backend, "compile", lambda spec: (release.wait(30), real(spec))[1])
    front = AsyncEngine(llm.engine)
    slow_ids = []
    slow = threading.Thread(target=lambda: slow_ids.append(
        front.submit({"prompt_token_ids": [3, 4]}, structured(0, max_tokens=5, regex="x+"))))
    try:
        slow.start()
        rid = front.submit({"prompt_token_ids": [3, 4, 5]}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        outs = list(front.stream(rid, timeout=30))
        assert slow.is_alive()  # the other request finished while the compile was still stuck
        release.set()
        slow.join(30)
        slow_out = reduce(accumulate, front.stream(slow_ids[0], timeout=30), None).outputs[0]
    finally:
        release.set()
        front.shutdown()
    assert outs[-1].finished and len(reduce(accumulate, outs, None).outputs[0].token_ids) == 6
    assert slow_out.finish_reason in ("stop", "length") and set(slow_out.text) <= {"x"}
    assert_all_blocks_free(llm.engine)


def test_jump_forward_appends_forced_tokens_and_output_stays_valid(tiny_model_dir):
    import jsonschema

    schema = {"type": "object", "additionalProperties": False, "required": ["alpha", "beta", "gamma"],
              "properties": {k: {"type": "integer", "minimum": 0, "maximum": 9} for k in ("alpha", "beta", "gamma")}}
    prompts = [{"prompt_token_ids": [3, 4, 5]}] * 4
    results = {}
    for jump in (False, True):
        llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, jump_forward=jump)
        steps = 0
        for i, p in enumerate(prompts):
            llm.engine.add_request(f"r{i}", p, structured(i, max_tokens=80, json=schema))
        totals = {}
        while llm.engine.has_unfinished():
            for o in llm.engine.step():  # deltas
                totals[o.request_id] = accumulate(totals.get(o.request_id), o)
            steps += 1
        assert len(totals) == 4 and all(t.finished for t in totals.values())
        for out in totals.values():
            jsonschema.validate(json.loads(out.outputs[0].text), schema)
        results[jump] = (steps, llm.engine.core.drafter.num_jump_forward_tokens)
        assert_all_blocks_free(llm.engine)
    assert results[False][1] == 0 and results[True][1] > 0
    assert results[True][0] < results[False][0]  # fewer forward passes for the same outputs' shape


def test_min_tokens_never_forces_a_token_the_grammar_forbids(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=32)
    params = SamplingParams(temperature=0, max_tokens=20, min_tokens=10, structured=StructuredOutputs(choice=["ab"]))
    out = llm.generate([{"prompt_token_ids": [3, 4]}], params)[0].outputs[0]
    assert out.text == "ab" and out.finish_reason == "stop"


def test_json_outputs_close_as_the_budget_runs_out(tiny_model_dir):
    """Where the budget guarantee is off: in the last json_close_window tokens a JSON output takes a closing
    token whenever its grammar allows one, so it ends valid instead of being cut off in an endless string."""
    import jsonschema

    schema = {"type": "object", "additionalProperties": False, "required": ["s", "xs"],
              "properties": {"s": {"type": "string"}, "xs": {"type": "array", "items": {"type": "string"}}}}
    prompts = [{"prompt_token_ids": [3, 4, 5]}] * 4
    params = [structured(seed, max_tokens=48, json=schema) for seed in range(4)]
    closing = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, json_close_window=24,  # the last 24
                  finish_within_budget=False)
    for out in closing.generate(prompts, params):
        c = out.outputs[0]
        assert c.finish_reason == "stop" and c.schema_violation is None, c.text
        jsonschema.validate(json.loads(c.text), schema)
    free = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, json_close_window=0, finish_within_budget=False)
    reasons = [out.outputs[0].finish_reason for out in free.generate(prompts, params)]
    assert "length" in reasons  # without it, random weights ramble inside the strings
