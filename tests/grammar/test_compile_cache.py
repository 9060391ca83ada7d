"""Compiled grammars on disk (issue 65, grammar/compile_cache.py): a fresh manager over the same folder (a
restarted server) reads what a compile wrote and masks exactly as a fresh compile does; the key changes with the
tokenizer, a backend's version, strictness and the tenant's namespace; a corrupt, truncated or misplaced entry is
a miss that is removed; the folder stays within its bytes, least recently used out; concurrent writers leave
whole entries only."""

import os
import random
import threading

import pytest
import torch
from transformers import AutoTokenizer

from loraplex.grammar import compile_cache
from loraplex.grammar.backend import StructuredOutputs
from loraplex.grammar.compile_cache import DiskCache, GrammarStore, pack, resolve_dir, unpack
from loraplex.grammar.manager import GrammarManager
from loraplex.grammar.tooling.reasoning import Reasoning
from loraplex.grammar.tooling.tools import Function, ToolCalls

VOCAB = 448
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "n"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer", "minimum": 0},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}}}}
LOOSE = {"type": "object", "required": ["d"], "properties": {"d": {"type": "string", "format": "no-such-format"}}}
TOOLS = ToolCalls((Function("get", {"type": "object", "additionalProperties": False, "required": ["city"],
                                    "properties": {"city": {"type": "string"}}}),), required=True)
SPECS = {
    "xgrammar": [StructuredOutputs(json=SCHEMA), StructuredOutputs(regex=r"[a-c]{2,4}@x\.com"),
                 StructuredOutputs(choice=["yes", "no", "maybe"]), StructuredOutputs(grammar='root ::= "a" root | "b"'),
                 StructuredOutputs(json_object=True)],
    "llguidance": [StructuredOutputs(json=SCHEMA, namespace="t1"), StructuredOutputs(regex=r"[a-c]{2,4}"),
                   StructuredOutputs(tools=TOOLS), StructuredOutputs(json=SCHEMA, reasoning=Reasoning("qwen3")),
                   StructuredOutputs(json=LOOSE, strict=False)],
    "outlines": [StructuredOutputs(regex=r"[a-c]{2,4}!"), StructuredOutputs(choice=["yes", "no"])],
}


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def manager(tok, folder, backend="auto", workers=0, **kw):
    return GrammarManager(tok, VOCAB, [tok.eos_token_id], backend=backend, timeout_s=60, workers=workers,
                          cache_dir=folder, **kw)


def trace(mgr, compiled, seed=0, steps=40) -> list[tuple[int, ...]]:
    """The allowed tokens at each step of a seeded random walk through the grammar."""
    rng, grammar, out = random.Random(seed), mgr.new_grammar(compiled), []
    for _ in range(steps):
        bitmask = torch.full((1, -(-VOCAB // 32)), -1, dtype=torch.int32)
        grammar.fill_bitmask(bitmask, 0)
        allowed = tuple(i for i in range(VOCAB) if (int(bitmask[0, i // 32]) >> (i % 32)) & 1)
        out.append(allowed)
        if not allowed or not grammar.accept_token(rng.choice(allowed)) or grammar.is_terminated():
            break
    return out


def no_compiles(mgr, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("compiled, not read from disk")

    monkeypatch.setattr(mgr.compiler, "compile", refuse)


@pytest.mark.parametrize("backend,workers", [("xgrammar", 0), ("llguidance", 0), ("outlines", 0), ("auto", 2)])
def test_a_restarted_manager_reads_what_a_compile_wrote_and_masks_the_same(tok, tmp_path, monkeypatch, backend,
                                                                             workers):
    specs = SPECS["llguidance" if backend == "auto" else backend]
    first = manager(tok, tmp_path, backend, workers)
    try:
        fresh = [first.compile(spec) for spec in specs]
        first.flush()
        assert first.store.disk.writes == len(specs) and first.store.disk.hits == 0
    finally:
        first.close()
    again = manager(tok, tmp_path, backend)  # the restart: nothing in memory
    no_compiles(again, monkeypatch)
    reference = manager(tok, None, backend)  # a fresh compile, no disk
    for spec, before in zip(specs, fresh):
        read = again.compile(spec)
        compiled = reference.compile(spec)
        assert (read.backend, read.spec, read.unenforced) == (compiled.backend, compiled.spec, compiled.unenforced)
        assert read.original == compiled.original
        for seed in range(3):
            assert trace(again, read, seed) == trace(reference, compiled, seed) == trace(first, before, seed)
        if spec.kind in ("json", "tools"):  # the output check reads the request's own schema
            assert (read.violation('{"name": 1}') is None) == (compiled.violation('{"name": 1}') is None)
    assert again.store.disk.hits == len(specs) and again.store.disk.misses == 0
    assert specs[-1].strict or read.unenforced  # strict: false kept what it dropped
    again.close()


def test_the_key_changes_with_tokenizer_versions_strictness_and_namespace(tok, tiny_model_dir, tmp_path, monkeypatch):
    spec = StructuredOutputs(json=SCHEMA)
    store = GrammarStore(tmp_path, 1 << 20, tok, VOCAB, [tok.eos_token_id], "auto")
    base = DiskCache.name(store.key(spec))
    other_tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    other_tok.add_tokens(["<extra>"])
    names = {
        "tokenizer": GrammarStore(tmp_path, 1 << 20, other_tok, VOCAB, [tok.eos_token_id], "auto").key(spec),
        "vocab": GrammarStore(tmp_path, 1 << 20, tok, VOCAB + 32, [tok.eos_token_id], "auto").key(spec),
        "stops": GrammarStore(tmp_path, 1 << 20, tok, VOCAB, [tok.eos_token_id, 0], "auto").key(spec),
        "backend": GrammarStore(tmp_path, 1 << 20, tok, VOCAB, [tok.eos_token_id], "xgrammar").key(spec),
        "strict": store.key(StructuredOutputs(json=SCHEMA, strict=False)),
        "openai_strict": store.key(StructuredOutputs(json=SCHEMA, openai_strict=True)),
        "whitespace": store.key(StructuredOutputs(json=SCHEMA, any_whitespace=True)),
        "namespace": store.key(StructuredOutputs(json=SCHEMA, namespace="tenant-b")),
    }
    versions = compile_cache.library_versions()
    monkeypatch.setattr(compile_cache, "library_versions", lambda: {**versions, "xgrammar": "999.0"})
    names["version"] = GrammarStore(tmp_path, 1 << 20, tok, VOCAB, [tok.eos_token_id], "auto").key(spec)
    named = {what: DiskCache.name(key) for what, key in names.items()}
    assert base not in named.values() and len(set(named.values())) == len(named), named

    # a library upgrade: the old entry is not read, the spec is compiled again under the new key
    monkeypatch.undo()
    old = manager(tok, tmp_path, "xgrammar")
    old.compile(spec)
    old.flush()
    monkeypatch.setattr(compile_cache, "library_versions", lambda: {**versions, "xgrammar": "999.0"})
    upgraded = manager(tok, tmp_path, "xgrammar")
    upgraded.compile(spec)
    upgraded.flush()
    assert upgraded.store.disk.hits == 0 and upgraded.store.disk.writes == 1
    assert len(list(tmp_path.glob("*.grammar"))) == 2


def test_a_tenants_entry_is_never_read_under_another_namespace(tok, tmp_path):
    mine = StructuredOutputs(json=SCHEMA, namespace="tenant-a")
    writer = manager(tok, tmp_path, "llguidance")
    writer.compile(mine)
    writer.flush()
    reader = manager(tok, tmp_path, "llguidance")
    reader.compile(StructuredOutputs(json=SCHEMA, namespace="tenant-b"))
    assert reader.store.disk.hits == 0 and reader.store.disk.misses == 1
    reader.compile(mine)
    assert reader.store.disk.hits == 1


@pytest.mark.parametrize("damage", ["truncated", "flipped", "garbage", "empty", "another key"])
def test_a_corrupt_entry_is_a_miss_and_is_removed(tok, tmp_path, damage):
    spec, other = StructuredOutputs(regex="a+b"), StructuredOutputs(regex="c+d")
    writer = manager(tok, tmp_path, "xgrammar")
    writer.compile(spec)
    writer.compile(other)
    writer.flush()
    path = tmp_path / DiskCache.name(writer.store.key(spec))
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[:len(data) // 2])
    elif damage == "flipped":
        path.write_bytes(data[:-10] + bytes([data[-10] ^ 1]) + data[-9:])
    elif damage == "garbage":
        path.write_bytes(os.urandom(len(data)))
    elif damage == "empty":
        path.write_bytes(b"")
    else:  # a whole, valid entry under the wrong name: its own key says so
        path.write_bytes((tmp_path / DiskCache.name(writer.store.key(other))).read_bytes())
    reader = manager(tok, tmp_path, "xgrammar")
    compiled = reader.compile(spec)  # compiled again, never the damaged or the other grammar
    reference = manager(tok, None, "xgrammar").compile(spec)
    assert compiled.spec == spec and trace(reader, compiled) == trace(reader, reference)
    assert reader.store.disk.hits == 0 and reader.store.disk.dropped == 1
    reader.flush()
    assert unpack(path.read_bytes(), reader.store.key(spec))  # rewritten whole
    assert reader.compile(other).spec == other


def test_an_entry_that_does_not_restore_is_dropped(tok, tmp_path, monkeypatch):
    spec = StructuredOutputs(regex="a+b")
    writer = manager(tok, tmp_path, "xgrammar")
    writer.compile(spec)
    writer.flush()
    key = writer.store.key(spec)
    path = tmp_path / DiskCache.name(key)
    header, payload = unpack(path.read_bytes(), key)
    path.write_bytes(pack(key, header, b"{not a grammar"))  # checksummed, but not xgrammar's
    reader = manager(tok, tmp_path, "xgrammar")
    assert reader.compile(spec).backend == "xgrammar"
    assert reader.store.disk.hits == 0 and reader.store.disk.dropped == 1


def test_the_folder_keeps_its_bytes_least_recently_used_out(tmp_path):
    cache = DiskCache(tmp_path, limit=10_000)
    keys = [{"n": i} for i in range(4)]
    for i, key in enumerate(keys[:3]):
        assert cache.put(key, {}, os.urandom(2500))  # incompressible: each entry is ~2.6 kB
        os.utime(tmp_path / cache.name(key), (1000 + i, 1000 + i))
    assert cache.get(keys[0]) is not None  # used: now the most recent
    assert cache.put(keys[3], {}, os.urandom(2500))
    assert cache.size <= 10_000 and cache.evictions == 1
    assert cache.get(keys[1]) is None  # the least recently used went
    assert all(cache.get(key) is not None for key in (keys[0], keys[2], keys[3]))
    assert not cache.put({"n": "huge"}, {}, os.urandom(20_000))  # larger than the whole folder: not kept
    restarted = DiskCache(tmp_path, limit=10_000)  # the bound holds across restarts (it scans the folder)
    assert restarted.size == cache.size


def test_concurrent_writers_leave_only_whole_entries(tmp_path):
    key = {"spec": "shared"}
    payloads = {bytes([i]) * 50_000 + os.urandom(1000) for i in range(8)}
    stop, seen, errors = threading.Event(), set(), []

    def write(payload):
        cache = DiskCache(tmp_path, limit=1 << 30)  # one per writer, as separate servers would have
        for _ in range(20):
            cache.put(key, {"len": len(payload)}, payload)

    def read():
        cache = DiskCache(tmp_path, limit=1 << 30)
        while not stop.is_set():
            try:
                found = cache.get(key)
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)
                return
            if found is not None:
                seen.add(found[1])
        if cache.dropped:
            errors.append(f"{cache.dropped} torn entries")

    readers = [threading.Thread(target=read) for _ in range(2)]
    writers = [threading.Thread(target=write, args=(p,)) for p in payloads]
    for thread in readers + writers:
        thread.start()
    for thread in writers:
        thread.join()
    stop.set()
    for thread in readers:
        thread.join()
    assert not errors and seen and seen <= payloads
    assert [p.name for p in tmp_path.iterdir()] == [DiskCache.name(key)]  # no temp file left behind


def test_an_unusable_folder_only_turns_the_cache_off(tok, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    mgr = manager(tok, blocked / "grammars", "xgrammar")
    assert mgr.compile(StructuredOutputs(regex="a+")).backend == "xgrammar"
    mgr.flush()
    assert mgr.store.disk.writes == 0


def test_the_setting(tmp_path, monkeypatch):
    assert resolve_dir("off") is None and resolve_dir(None) is None
    assert resolve_dir(str(tmp_path)) == tmp_path
    monkeypatch.setenv("LORAPLEX_GRAMMAR_CACHE", str(tmp_path / "g"))
    assert resolve_dir("auto") == tmp_path / "g"
    monkeypatch.setenv("LORAPLEX_GRAMMAR_CACHE", "off")
    assert resolve_dir("auto") is None
    monkeypatch.delenv("LORAPLEX_GRAMMAR_CACHE")
    monkeypatch.setenv("LORAPLEX_CACHE", str(tmp_path / "c"))
    assert resolve_dir("auto") == tmp_path / "c" / "grammars"


def test_an_engine_keeps_its_grammars_across_a_restart(tiny_model_dir, tmp_path):
    from loraplex.platform import LLM
    from loraplex.platform.request import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=24, structured=StructuredOutputs(json=SCHEMA))
    outputs = []
    for _ in range(2):
        llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, grammar_compile_workers=0,
                  grammar_cache_dir=str(tmp_path))
        outputs.append(llm.generate([{"prompt_token_ids": [3, 4, 5]}], params)[0].outputs[0].text)
        llm.engine.grammars.flush()
        store = llm.engine.grammars.store
        llm.engine.close()
    assert store.disk.hits == 1 and outputs[0] == outputs[1]
    assert len(list(tmp_path.glob("*.grammar"))) == 1


def test_the_start_plan_comes_back_from_disk_and_is_not_searched_again(tok, tmp_path, monkeypatch):
    """The budget guarantee's start plan (grammar/budget.py) is kept with the compile: a restart reads it."""
    spec = StructuredOutputs(json=SCHEMA)
    first = manager(tok, tmp_path, "llguidance", within_budget=True)
    planned = first.compile(spec).budget_plan
    first.flush()
    first.close()
    assert planned and planned[0]
    again = manager(tok, tmp_path, "llguidance", within_budget=True)
    monkeypatch.setattr(again, "_plan", lambda compiled: pytest.fail("planned again, not read from disk"))
    read = again.compile(spec)
    assert read.budget_plan == planned and again.shortest(read) == len(planned[0])
    again.close()
    off = manager(tok, tmp_path, "llguidance")  # the same entry where the guarantee is off: no guard
    assert off.shortest(off.compile(spec)) is None and off.new_grammar(off.compile(spec)).guard is None
    off.close()
