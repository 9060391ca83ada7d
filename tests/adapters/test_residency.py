"""Residency: the disk tier of prepared weights, the prefetcher filling slots beside a step, and the engine
admitting a request only once its adapters are in (counted in steps and slot fills, never in seconds)."""

import pytest
import torch

from loraplex.adapters.prefetch import Prefetcher
from loraplex.adapters.registry import AdapterRegistry
from loraplex.adapters.spill import SpillStore
from loraplex.platform.config import EngineConfig
from loraplex.platform.engine.llm_engine import Engine
from loraplex.platform.models.registry import read_model_config
from loraplex.platform.request import SamplingParams
from tests.conftest import forced_kernels

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def registry_for(tiny_model_dir, tmp_path, spill_bytes=1 << 30, **kw) -> AdapterRegistry:
    kw = {"max_loras": 1, "max_cpu_loras": 1, **kw}
    return AdapterRegistry(read_model_config(tiny_model_dir), max_lora_rank=16, dtype=torch.float32,
                           spill=SpillStore(spill_bytes, str(tmp_path)), **kw)


def test_an_adapter_the_cpu_cache_dropped_comes_back_from_its_prepared_file(tiny_model_dir, tiny_adapters,
                                                                           tmp_path, monkeypatch):
    import loraplex.adapters.registry as reg

    registry = registry_for(tiny_model_dir, tmp_path)
    registry.load("a0", str(tiny_adapters[0]))
    registry.load("a1", str(tiny_adapters[1]))  # max_cpu_loras=1: a0 leaves memory, kept on disk
    registry.spill.flush()
    assert registry.status()["a0"].tier == "spill" and registry.status()["a1"].tier == "cpu"
    assert registry.spill.usage()[0] == 1
    reads = []
    monkeypatch.setattr(reg, "read_peft_adapter", lambda *a, **k: reads.append(a[0]))
    weights = registry.prefetch("a0")
    assert reads == []  # not parsed from its folder again
    fresh = read_peft_adapter_direct(registry, tiny_adapters[0])
    assert weights.projections.keys() == fresh.projections.keys()
    assert all(torch.equal(weights.projections[k][i], fresh.projections[k][i])
               for k in fresh.projections for i in (0, 1))
    status = registry.status()["a0"]
    assert (status.tier, status.misses, status.bytes_read) == ("cpu", 1, weights.nbytes)
    registry.prefetch("a0")
    assert registry.status()["a0"].hits == 1


def read_peft_adapter_direct(registry, folder):
    from loraplex.adapters.peft_format import read_peft_adapter

    return read_peft_adapter("x", str(folder), registry.config, 16, torch.float32)


def test_the_disk_tier_is_bounded_and_an_unloaded_adapter_leaves_it(tiny_model_dir, tiny_adapters, tmp_path):
    one = sum(a.nbytes + b.nbytes for a, b in read_peft_adapter_direct(
        registry_for(tiny_model_dir, tmp_path), tiny_adapters[1]).projections.values())  # rank 8
    registry = registry_for(tiny_model_dir, tmp_path, spill_bytes=one)
    for i in (1, 3, 5):  # rank 8 each; each load pushes the one before out of memory, onto disk
        registry.load(f"a{i}", str(tiny_adapters[i]))
        registry.spill.flush()
    assert registry.spill.usage() == (1, one)  # room for one: a1's file went when a3's came
    assert [registry.status()[f"a{i}"].tier for i in (1, 3, 5)] == ["disk", "spill", "cpu"]
    registry.unload("a3")
    assert registry.spill.usage() == (0, 0) and not list(tmp_path.glob("*/*.bin"))


def test_the_prefetcher_fills_a_stacked_slot_the_running_step_does_not_use(tiny_model_dir, tiny_adapters,
                                                                           tmp_path):
    registry = registry_for(tiny_model_dir, tmp_path, max_loras=2, max_cpu_loras=3, stacked=True)
    for i in range(3):
        registry.load(f"a{i}", str(tiny_adapters[i]))
        registry.pin(f"a{i}")
    prefetcher = Prefetcher(registry)
    try:
        assert registry.assign_slots({"a0"}) == {"a0": 0} and registry.num_step_loads == 1
        assert not registry.ready(("a1",))
        prefetcher.want(("a1",))
        assert prefetcher.wait_idle(10)
        assert registry.ready(("a1",)) and registry.status()["a1"].resident
        assert registry.assign_slots({"a0", "a1"}) == {"a0": 0, "a1": 1}
        assert registry.num_step_loads == 1  # the step found a1 in its slot
        prefetcher.want(("a2",))  # both slots are the running step's: a2 waits
        assert prefetcher.wait_idle(10) and not registry.ready(("a2",))
        assert registry.assign_slots({"a1"}) == {"a1": 1}
        prefetcher.want(("a2",))  # slot 0 is free of the step now
        assert prefetcher.wait_idle(10) and registry.ready(("a2",)) and not registry.ready(("a0",))
    finally:
        prefetcher.close()


def test_a_queued_requests_adapter_is_in_a_slot_before_its_first_step(tiny_model_dir, tiny_adapters):
    """One seat: the second request waits while the first runs; the prefetcher puts its adapter in a slot
    beside the first request's steps, so the step that admits it fills none itself."""
    engine = Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64, max_num_seqs=1,
                                 max_loras=2))
    try:
        for i in range(2):
            engine.adapters.load(f"a{i}", str(tiny_adapters[i]))
        engine.add_request("r0", {"prompt_token_ids": [1, 2, 3]}, GREEDY, "a0")
        engine.add_request("r1", {"prompt_token_ids": [4, 5, 6]}, GREEDY, "a1")
        engine.step()
        assert engine.core.prefetcher.wait_idle(10)
        waiting = [r.request_id for r in engine.core.scheduler.waiting]
        assert waiting == ["r1"] and engine.adapters.status()["a1"].resident
        loads = engine.adapters.num_step_loads
        while engine.has_unfinished():
            engine.step()
        assert engine.adapters.num_step_loads == loads == 1  # only r0's, in the first (idle) step
    finally:
        engine.core.close()


def test_with_stacked_slots_a_base_request_never_waits_on_a_slot_being_filled(tiny_model_dir, tiny_adapters):
    """The GPU's layout (Triton under the interpreter): an adapter request and a base request arrive while
    another runs; the base request runs in the next step, the adapter request once the prefetcher filled its
    slot, and no step with running work fills a slot itself."""
    pytest.importorskip("triton")
    with forced_kernels("triton"):
        engine = Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64, max_loras=2))
    try:
        assert engine.adapters.slots.stacked
        for i in range(2):
            engine.adapters.load(f"a{i}", str(tiny_adapters[i]))
        engine.add_request("r0", {"prompt_token_ids": [1, 2, 3]}, GREEDY, "a0")
        engine.step()
        engine.add_request("r1", {"prompt_token_ids": [4, 5, 6]}, GREEDY, "a1")
        engine.add_request("base", {"prompt_token_ids": [7, 8, 9]}, GREEDY)
        engine.step()
        running = {r.request_id for r in engine.core.scheduler.running}
        assert "base" in running and "r1" not in running
        for _ in range(20):
            engine.core.prefetcher.wait_idle(10)
            if not engine.has_unfinished():
                break
            engine.step()
        assert not engine.has_unfinished() and engine.adapters.num_step_loads == 1  # r0's, into an idle engine
    finally:
        engine.core.close()


def test_a_step_waits_for_a_fill_under_way_instead_of_taking_its_slot(tiny_model_dir, tiny_adapters, tmp_path):
    """The prefetcher is copying W into a slot when a step (an idle one, which may admit adapters not in yet)
    needs W and B: the step used to fill W again elsewhere, then found no slot for B (StopIteration) while the
    first copy went on into a slot it had emptied. Now it waits for W's fill and fills only B."""
    import threading

    registry = registry_for(tiny_model_dir, tmp_path, max_loras=2, max_cpu_loras=3, stacked=True)
    for i, name in enumerate("AWB"):
        registry.load(name, str(tiny_adapters[i]))
        registry.pin(name)
    assert registry.assign_slots({"A"}) == {"A": 0}
    registry.assign_slots(set())  # A's requests ended: its slot is free for the prefetcher
    started, release = threading.Event(), threading.Event()
    real = registry.slots.load_projections
    registry.slots.load_projections = lambda *a: (started.set(), release.wait(10), real(*a))
    filling = threading.Thread(target=registry.preload, args=("W", set()))
    filling.start()
    assert started.wait(10)
    got: dict = {}
    step = threading.Thread(target=lambda: got.update(registry.assign_slots({"W", "B"})))
    step.start()
    release.set()
    step.join(10)
    filling.join(10)
    assert got == {"W": 1, "B": 0} and registry.num_step_loads == 2  # A's first fill, then B's; W's was preload's
    assert registry.ready(("W", "B"))


def test_an_engine_nobody_closes_is_still_freed_with_its_threads(tiny_model_dir, tiny_adapters):
    """The prefetcher's thread held the registry (and through it the model and every adapter in memory): each
    engine a process dropped without closing stayed alive, and a test run ran out of memory."""
    import gc
    import threading
    import weakref

    before = set(threading.enumerate())
    engine = Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64, max_loras=1,
                                 max_cpu_loras=1))
    for i in range(2):
        engine.adapters.load(f"a{i}", str(tiny_adapters[i]))  # the second pushes the first onto disk
    engine.add_request("r0", {"prompt_token_ids": [1, 2, 3]}, GREEDY, "a0")
    while engine.has_unfinished():
        engine.step()
    registry, store = weakref.ref(engine.adapters), weakref.ref(engine.adapters.spill)
    threads = [t for t in threading.enumerate() if t not in before and t.name in ("loraplex-prefetch", "loraplex-spill")]
    assert len(threads) == 2
    del engine
    gc.collect()
    assert registry() is None and store() is None
    for thread in threads:
        thread.join(10)
    assert not any(t.is_alive() for t in threads)


def _within(seconds: float, call) -> dict:
    """`call()` on a thread; its result, or a failure (not a hang) where it blocks past `seconds`."""
    import threading

    got: dict = {}
    thread = threading.Thread(target=lambda: got.update(result=call()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "blocked: a step waiting for a slot that no fill will free"
    return got["result"]


def test_a_replaced_adapter_is_filled_again_into_its_own_stale_slot(tiny_model_dir, tiny_adapters, tmp_path):
    """One slot, holding A's old version: the step's fill counted that slot as another adapter's and waited for a
    free one forever."""
    registry = registry_for(tiny_model_dir, tmp_path, stacked=True)
    registry.load("A", str(tiny_adapters[0]))
    registry.pin("A")
    assert registry.assign_slots({"A"}) == {"A": 0}
    registry.unpin("A")
    registry.load("A", str(tiny_adapters[2]), replace=True)
    registry.pin("A")
    assert _within(30, lambda: registry.assign_slots({"A"})) == {"A": 0}
    assert registry.ready(("A",)) and registry.num_step_loads == 2


def test_a_step_filling_an_adapter_the_prefetcher_takes_meanwhile_uses_that_fill(tiny_model_dir, tiny_adapters,
                                                                                  tmp_path):
    """While the step read A's weights (the lock released), the prefetcher claimed the only slot for A: the step
    then waited for a free slot forever. Now it waits for that fill and uses it."""
    import threading

    registry = registry_for(tiny_model_dir, tmp_path, stacked=True)
    registry.load("A", str(tiny_adapters[0]))
    registry.pin("A")
    claimed, release = threading.Event(), threading.Event()
    real_load, real_weights = registry.slots.load_projections, registry._weights
    registry.slots.load_projections = lambda *a: (claimed.set(), release.wait(30), real_load(*a))

    def weights_then_prefetcher_claims(info):
        weights = real_weights(info)
        if threading.current_thread().name == "step":
            threading.Thread(target=registry.preload, args=("A", set()), daemon=True).start()
            assert claimed.wait(30)
            threading.Timer(0.2, release.set).start()
        return weights

    registry._weights = weights_then_prefetcher_claims
    got: dict = {}
    step = threading.Thread(target=lambda: got.update(registry.assign_slots({"A"})), name="step", daemon=True)
    step.start()
    step.join(30)
    assert not step.is_alive() and got == {"A": 0}
    assert registry.num_step_loads == 0 and registry.num_preloads == 1  # the step filled nothing itself
