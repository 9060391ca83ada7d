"""Compiles in a pool of worker processes (issue 43): a compile past its timeout is killed with
its process and the pool refills; a spec already compiling is compiled once for all who wait;
workers run at a lower CPU priority, without torch under llguidance, and end with the pool."""

import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from transformers import AutoTokenizer

from loraplex.grammar.backend import GrammarError, StructuredOutputs
from loraplex.grammar.compile_pool import NICE
from loraplex.grammar.manager import GrammarManager

HOSTILE = {"type": "string", "pattern": "^[^a]{1,3000}$"}  # xgrammar compiles it for tens of seconds
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["n"], "properties": {"n": {"type": "integer"}}}


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def xgrammar(tok):
    manager = GrammarManager(tok, 448, [tok.eos_token_id], backend="xgrammar", timeout_s=60.0, workers=2)
    yield manager
    manager.close()


@pytest.fixture(scope="module")
def auto(tok):
    manager = GrammarManager(tok, 448, [tok.eos_token_id], backend="auto", workers=2)
    yield manager
    manager.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def pids(manager) -> set[int]:
    return {w.pid for w in manager.pool._procs.values() if w is not None}


def wait_warm(manager) -> None:
    for _ in range(600):
        if manager.warm:
            return
        time.sleep(0.1)
    raise AssertionError("the compile workers did not all start")


def test_a_compile_past_its_timeout_is_killed_and_the_pool_refills(xgrammar):
    """Only the hostile compile is held to 1 s: on a loaded machine the niced workers may take longer than that over
    an ordinary spec (a fresh worker's first compile), which is not what this test is about."""
    assert xgrammar.compile(StructuredOutputs(regex="x+")).backend == "xgrammar"
    wait_warm(xgrammar)  # the other slot may still be forking its worker: `before` must hold both
    before, compiles = pids(xgrammar), xgrammar.pool.num_compiles
    xgrammar.timeout_s = 1.0
    with pytest.raises(GrammarError, match="json took longer than 1s to compile"):
        xgrammar.compile(StructuredOutputs(json=HOSTILE))
    xgrammar.timeout_s = 60.0
    # ended by the timeout's kill, not by the compile finishing (it runs for tens of seconds): counted, not timed
    assert xgrammar.pool.num_killed == 1 and xgrammar.pool.num_compiles == compiles + 1
    killed = before - pids(xgrammar)
    assert len(killed) == 1 and not any(alive(pid) for pid in killed)  # gone, not abandoned
    assert len(pids(xgrammar)) == 2  # its replacement
    assert xgrammar.compile(StructuredOutputs(json=SCHEMA)).backend == "xgrammar"


def test_every_waiter_of_a_spec_in_flight_shares_its_one_compile(auto):
    spec = StructuredOutputs(json={**SCHEMA, "title": "shared"})
    before = auto.pool.num_compiles
    futures = [auto.submit(spec) for _ in range(8)]
    results = [f.result(timeout=60) for f in futures]
    assert all(r is results[0] for r in results) and auto.pool.num_compiles == before + 1
    with ThreadPoolExecutor(8) as threads:  # and from threads, the cache
        assert set(map(id, threads.map(lambda _: auto.compile(spec), range(8)))) == {id(results[0])}
    assert auto.pool.num_compiles == before + 1


def test_a_waiter_that_leaves_does_not_cancel_the_others(auto):
    spec = StructuredOutputs(json={**SCHEMA, "title": "left"})
    first, second = auto.submit(spec), auto.submit(spec)
    first.cancel()
    assert second.result(timeout=60).backend == "llguidance"


def test_refusals_and_errors_cross_from_the_worker_whole(auto):
    with pytest.raises(GrammarError, match="'pattern' at #/properties/s .*lookahead") as err:
        auto.compile(StructuredOutputs(json={"type": "object", "properties": {"s": {"type": "string",
                                                                                   "pattern": "a(?=b)"}}}))
    assert err.value.keyword == "pattern"
    with pytest.raises(GrammarError, match="json schema is invalid at #/maxLength"):
        auto.compile(StructuredOutputs(json={"type": "string", "maxLength": -3}))


def test_workers_run_niced_and_without_torch_under_llguidance(auto):
    auto.compile(StructuredOutputs(regex="[a-c]+"))
    for pid in pids(auto):
        assert os.getpriority(os.PRIO_PROCESS, pid) >= NICE
        with open(f"/proc/{pid}/maps") as maps:
            assert "libtorch" not in maps.read()


def test_close_ends_every_process_and_later_compiles_are_refused(tok):
    manager = GrammarManager(tok, 448, [tok.eos_token_id], backend="llguidance", workers=2)
    manager.compile(StructuredOutputs(regex="z+"))
    workers, zygote = pids(manager), manager.pool._zygote.proc
    manager.close()
    assert zygote.poll() is not None and not any(alive(pid) for pid in workers)
    with pytest.raises(GrammarError, match="shut down"):
        manager.compile(StructuredOutputs(regex="q+"))


def test_a_spec_found_on_disk_never_reaches_a_worker(tok, tmp_path):
    """The disk cache (grammar/compile_cache.py) is read before the pool: a restarted manager serves what a
    worker compiled before without starting one; a spec it lacks is compiled by a worker and written."""
    spec = StructuredOutputs(json=SCHEMA)
    writer = GrammarManager(tok, 448, [tok.eos_token_id], backend="xgrammar", workers=2, cache_dir=tmp_path)
    try:
        assert writer.compile(spec).backend == "xgrammar"
        writer.flush()
        assert writer.pool.num_compiles == 1 and writer.store.disk.writes == 1
    finally:
        writer.close()
    reader = GrammarManager(tok, 448, [tok.eos_token_id], backend="xgrammar", workers=2, cache_dir=tmp_path)
    try:
        grammar = reader.new_grammar(reader.compile(spec))
        assert grammar.accept_token(tok.convert_tokens_to_ids("{"))
        assert reader.store.disk.hits == 1 and reader.pool.num_compiles == 0 and not reader.pool._slots
        reader.compile(StructuredOutputs(regex="[a-c]+"))
        reader.flush()
        assert reader.pool.num_compiles == 1 and reader.store.disk.writes == 1
    finally:
        reader.close()
