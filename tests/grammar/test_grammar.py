"""Specs, compile errors, and random-logit walks through the masks to termination (no model)."""

import json
import re
import time

import pytest
import torch
from transformers import AutoTokenizer

from loraplex.grammar.backend import GrammarError, StructuredOutputs
from loraplex.grammar.manager import GrammarManager

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "tags", "kind"],
          "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                  "minItems": 1, "maxItems": 3},
                         "kind": {"enum": ["a", "b"]},
                         "note": {"anyOf": [{"type": "null"}, {"type": "boolean"}]}}}
EBNF = 'root ::= expr\nexpr ::= num | "(" expr op expr ")"\nop ::= "+" | "*"\nnum ::= [1-9]'


@pytest.fixture(scope="module")
def manager(tiny_model_dir):
    """xgrammar's (tests/grammar/test_llguidance.py has llguidance's, test_oracle.py all)."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return GrammarManager(tok, vocab_size=448, stop_token_ids=[tok.eos_token_id], backend="xgrammar"), tok


@pytest.mark.parametrize("kwargs,message", [
    ({}, "exactly one of"),
    ({"json": {}, "regex": "a"}, "exactly one of"),
    ({"choice": []}, "non-empty list"),
    ({"choice": ["a", 3]}, "non-empty strings"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": [1, 2]}, "must be an object"),
    ({"regex": "  "}, "non-empty string"),
])
def test_bad_specs(kwargs, message):
    with pytest.raises(GrammarError, match=message):
        StructuredOutputs(**kwargs)


@pytest.mark.parametrize("spec,message", [
    (StructuredOutputs(regex="a(b"), "invalid regex"),
    (StructuredOutputs(grammar="root ::= "), "invalid grammar"),
    (StructuredOutputs(json={"type": "object", "properties": {"x": {"not": {"pattern": "^a"}}}}), "'not' at #/properties/x"),
    (StructuredOutputs(json={"type": "array", "uniqueItems": True}), "'uniqueItems'"),
    (StructuredOutputs(json={"type": "integer", "multipleOf": 3}), "'multipleOf'"),
])
def test_compile_errors_are_clear(manager, spec, message):
    with pytest.raises(GrammarError, match=message):
        manager[0].compile(spec)


def walk(manager, tok, spec, seed, max_steps=300):
    """Sample from random logits through the mask until the grammar terminates."""
    mgr = manager
    grammar = mgr.new_grammar(mgr.compile(spec))
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(max_steps):
        logits = torch.randn(1, 448, generator=g) * 3
        mgr.apply(logits, [grammar])
        token = int(torch.multinomial(torch.softmax(logits[0], -1), 1, generator=g))
        assert grammar.accept_token(token)
        if grammar.is_terminated():
            return tok.decode(out)
        out.append(token)
    pytest.fail(f"no termination within {max_steps} steps: {tok.decode(out)!r}")


@pytest.mark.parametrize("seed", range(4))
def test_random_walks_end_in_valid_output(manager, seed):
    import jsonschema

    mgr, tok = manager
    text = walk(mgr, tok, StructuredOutputs(json=SCHEMA), seed)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert re.fullmatch(r"[a-c]{2,4}-\d\d", walk(mgr, tok, StructuredOutputs(regex=r"[a-c]{2,4}-\d\d"), seed))
    assert walk(mgr, tok, StructuredOutputs(choice=["yes", "no way", "maybe"]), seed) in ("yes", "no way", "maybe")
    assert isinstance(json.loads(walk(mgr, tok, StructuredOutputs(json_object=True), seed, 2000)), dict)
    expr = walk(mgr, tok, StructuredOutputs(grammar=EBNF), seed, 2000)
    assert re.fullmatch(r"[()+*1-9]+", expr) and isinstance(eval(expr), int)  # parses as the grammar says


def test_slow_compile_times_out_alone(manager, monkeypatch):
    mgr, _ = manager
    fast = mgr.compile(StructuredOutputs(regex="x+"))
    slow = GrammarManager(*mgr._args, backend="xgrammar", timeout_s=0.2)
    backend = slow._get("xgrammar")
    real = backend.compile
    monkeypatch.setattr(backend, "compile", lambda spec: (time.sleep(1.0), real(spec))[1])
    with pytest.raises(GrammarError, match="longer than 0.2s"):
        slow.compile(StructuredOutputs(regex="y+"))
    assert fast is not None


@pytest.mark.parametrize("kwargs,message", [
    ({"json": "null"}, "got null"),  # was silently "any object"
    ({"json": "[" * 5000 + "]" * 5000}, "nests deeper"),  # was a RecursionError (500)
    ({"json": {"type": "object", "properties": {"a": {"items": {"items": {"items": {}}}}}}}, None),
    ({"regex": "a" * 20000}, "longer than"),
    ({"choice": ["x"] * 1025}, "at most 1024"),
])
def test_hostile_specs_are_refused_by_name(kwargs, message):
    if message is None:
        StructuredOutputs(**kwargs)  # ordinary nesting is fine
        return
    with pytest.raises(GrammarError, match=message):
        StructuredOutputs(**kwargs)


def test_deeply_nested_schema_objects_are_refused():
    schema: dict = {}
    for _ in range(200):
        schema = {"items": schema}
    with pytest.raises(GrammarError, match="nests deeper"):
        StructuredOutputs(json=schema)


def test_choices_outside_the_basic_plane_can_be_generated(default_model_dir):
    """An emoji choice compiles to UTF-8 the tokens can spell (it used to need lone surrogates)."""
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    manager = GrammarManager(tok, vocab_size=len(tok), stop_token_ids=[tok.eos_token_id])
    grammar = manager.new_grammar(manager.compile(StructuredOutputs(choice=["\U0001F600 yes", "no"])))
    for token in tok.encode("\U0001F600 yes", add_special_tokens=False):
        assert grammar.accept_token(token)
    assert grammar.accept_token(tok.eos_token_id) or grammar.is_terminated()


def test_a_compile_past_its_timeout_frees_its_worker(tiny_model_dir, monkeypatch):
    """Slow specs time out and go on compiling in the background; a trivial spec right after
    compiles at once (a shared two-thread pool stayed wedged), and the number of compiles
    running at once is bounded. "At once" is shown by order, not by seconds: the trivial
    compile runs while all three slow ones are still held inside the backend."""
    import threading

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    manager = GrammarManager(tok, vocab_size=448, stop_token_ids=[tok.eos_token_id], backend="xgrammar",
                             timeout_s=0.3, max_compiles=4)
    backend = manager._get("xgrammar")
    real = backend.compile
    release, changed = threading.Event(), threading.Condition()
    held, finished, held_when_others_ran = [0], [0], []

    def compile_spy(spec):
        if spec.kind != "regex":
            with changed:
                held_when_others_ran.append(held[0])
            return real(spec)
        with changed:
            held[0] += 1
            changed.notify_all()
        try:
            release.wait(60)  # a safety net: the test releases them
            return real(spec)
        finally:
            with changed:
                held[0] -= 1
                finished[0] += 1
                changed.notify_all()

    monkeypatch.setattr(backend, "compile", compile_spy)
    try:
        for i in range(3):
            with pytest.raises(GrammarError, match="took longer than"):
                manager.compile(StructuredOutputs(regex=f"slow{i}"))
        with changed:  # all three are inside the backend, each holding its thread (safety net: 30 s)
            assert changed.wait_for(lambda: held[0] == 3, timeout=30), held
        manager.timeout_s = 60.0  # a safety net only: the order below shows that it ran at once
        assert manager.compile(StructuredOutputs(choice=["yes", "no"])).backend == "xgrammar"
        assert held_when_others_ran == [3]  # it compiled while the three slow compiles still held theirs
        manager.timeout_s = 0.3
        with pytest.raises(GrammarError, match="took longer"):
            manager.compile(StructuredOutputs(regex="slow3"))
        with pytest.raises(GrammarError, match="already running"):  # 4 abandoned compiles: the bound
            manager.compile(StructuredOutputs(choice=["a"]))
        assert held_when_others_ran == [3]  # the refused spec never reached the backend
    finally:
        release.set()
    with changed:  # the abandoned compiles finish (safety net: 60 s) ...
        assert changed.wait_for(lambda: finished[0] == 4, timeout=60), finished
    for _ in range(600):  # ... and give their places back (a safety net of 30 s: it takes a moment)
        try:
            manager.compile(StructuredOutputs(choice=["later"]))
            break
        except GrammarError:
            time.sleep(0.05)
    else:
        raise AssertionError("the abandoned compiles never gave their places back")


def test_the_device_bitmask_masks_as_xgrammar_does():
    """The bitmask as applied on a CUDA device (plain tensor ops) equals xgrammar's CPU kernel
    (columns past the vocab, a padded lm_head's, untouched by both)."""
    import xgrammar as xgr

    from loraplex.grammar.manager import apply_bitmask

    g = torch.Generator().manual_seed(0)
    vocab, width = 100, 104  # a padded lm_head: 4 columns past the vocab
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, -(-vocab // 32)), dtype=torch.int32, generator=g)
    logits = torch.randn(5, width, generator=g)
    expected, got = logits.clone(), logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask, vocab_size=vocab, indices=[0, 2, 3])
    apply_bitmask(got, bitmask, [0, 2, 3], vocab)
    assert torch.equal(got, expected)
    assert torch.isinf(got[[0, 2, 3], :vocab]).any() and torch.equal(got[[1, 4]], logits[[1, 4]])


def test_compiles_are_cached_per_namespace(tiny_model_dir, monkeypatch):
    """A tenant's compile is neither reused by nor waited for by another tenant, in the manager's cache or in
    any backend's own (its timing would tell that the other sent the schema); within one namespace the cache
    and the single flight hold as before."""
    import asyncio

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    for name in ("llguidance", "xgrammar"):
        manager = GrammarManager(tok, vocab_size=448, stop_token_ids=[tok.eos_token_id], backend=name)
        backend = manager._get(name)
        built = []
        if name == "llguidance":  # below its compile cache: what it really builds
            real = backend._build
            monkeypatch.setattr(backend, "_build", lambda spec: (built.append(spec.key), real(spec))[1])
        else:
            real = backend.compiler.compile_grammar
            monkeypatch.setattr(backend.compiler, "compile_grammar", lambda *a, **k: (built.append(1), real(*a, **k))[1])
        spec = StructuredOutputs(choice=["left", "right"])

        async def run():
            for namespace in ("tenant:acme", "tenant:globex", "tenant:acme", "", ""):
                await manager.compiled(spec, namespace)

        asyncio.run(run())
        assert len(built) == 3, name  # acme, globex, the server-wide namespace: once each
