import threading

import pytest
import torch

from loraplex.adapters.peft_format import AdapterError
from loraplex.adapters.registry import AdapterInUseError, AdapterRegistry, UnknownAdapterError
from loraplex.platform.models.registry import read_model_config


@pytest.fixture
def registry(tiny_model_dir):
    return AdapterRegistry(read_model_config(tiny_model_dir), max_loras=2, max_lora_rank=16,
                           max_cpu_loras=3, dtype=torch.float32)


def test_load_replace_unload(registry, tiny_adapters):
    info = registry.load("a", str(tiny_adapters[0]))
    assert info.rank == 16 and registry.get("a") == info
    with pytest.raises(AdapterError, match="already loaded"):
        registry.load("a", str(tiny_adapters[1]))
    replaced = registry.load("a", str(tiny_adapters[1]), replace=True)
    assert replaced.content_hash != info.content_hash and registry.get("a").rank == 8
    registry.unload("a")
    with pytest.raises(UnknownAdapterError, match="unknown adapter 'a'"):
        registry.get("a")
    with pytest.raises(ValueError):  # an unknown adapter is a ValueError for callers
        registry.unload("a")


def test_failed_load_registers_nothing(registry, tmp_path):
    with pytest.raises(AdapterError):
        registry.load("broken", str(tmp_path))
    assert registry.list() == []
    with pytest.raises(AdapterError, match="without ':'"):
        registry.load("base:x", str(tmp_path))


def test_pinned_adapter_cannot_be_unloaded_or_replaced(registry, tiny_adapters):
    registry.load("a", str(tiny_adapters[0]))
    registry.pin("a")
    with pytest.raises(AdapterInUseError, match="in use by 1 request"):
        registry.unload("a")
    with pytest.raises(AdapterInUseError):
        registry.load("a", str(tiny_adapters[1]), replace=True)
    registry.unpin("a")
    registry.unload("a")
    with pytest.raises(RuntimeError):
        registry.unpin("a")


def test_slots_are_reused_lru_and_point_at_the_cached_weights(registry, tiny_adapters):
    for i in range(5):
        registry.load(f"a{i}", str(tiny_adapters[i]))
    assert list(registry._cpu) == ["a2", "a3", "a4"]  # max_cpu_loras=3
    assert registry.assign_slots({"a0", "a1"}) == {"a0": 0, "a1": 1}  # a0, a1 re-read from disk
    assert registry.assign_slots({"a1"}) == {"a1": 1} and registry.num_slot_loads == 2
    assert registry.assign_slots({"a1", "a2"}) == {"a1": 1, "a2": 0}  # evicts a0, the LRU slot
    table = registry.slots.layers[0]["qkv_proj"]
    assert table.ranks == [16, 8] and table.scales == [2.0, 2.0]  # a2: rank 16 in slot 0, a1: rank 8
    a, b = registry._weights(registry.get("a1")).projections[(0, "qkv_proj")]
    assert table.a[1] is a and table.b[1] is b  # no copy: the slot reads the cached tensors in place
    assert int(table.a_ptrs[1]) == a.data_ptr() and a.shape == (3 * 8, 64)  # compact: rank 8, not 16
    with pytest.raises(RuntimeError, match="max_loras"):
        registry.assign_slots({"a1", "a2", "a3"})


def test_cpu_cache_is_bounded_by_bytes_and_evicted_slots_let_go(tiny_model_dir, tiny_adapters):
    config = read_model_config(tiny_model_dir)
    one = AdapterRegistry(config, 2, 16, None, torch.float32)
    one.load("a0", str(tiny_adapters[0]))  # rank 16
    size = one.memory()[1]
    registry = AdapterRegistry(config, 2, 16, None, torch.float32, lora_memory=2 * size)
    for i in (0, 2, 4):  # three rank-16 adapters, room for two
        registry.load(f"a{i}", str(tiny_adapters[i]))
    assert list(registry._cpu) == ["a2", "a4"] and registry.memory() == (2, 2 * size)
    assert registry.assign_slots({"a2"}) == {"a2": 0} and registry.assign_slots({"a4"}) == {"a4": 1}
    registry.load("a6", str(tiny_adapters[6]))  # evicts a2 (least recently used), which slot 0 pointed at
    table = registry.slots.layers[0]["o_proj"]
    assert "a2" not in registry._cpu and table.a[0] is None and table.a[1] is not None
    registry.unload("a6")
    assert registry.memory() == (1, size)


def test_concurrent_loads_are_safe(registry, tiny_adapters):
    errors = []

    def load(i):
        try:
            registry.load(f"t{i}", str(tiny_adapters[i % 8]))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=load, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(registry.list()) == 8


def test_cpu_lru_keeps_pinned_adapters_and_prefetch_reads_them_back(registry, tiny_adapters, monkeypatch):
    import loraplex.adapters.registry as reg

    for i in range(3):
        registry.load(f"a{i}", str(tiny_adapters[i]))
    registry.pin("a0")
    registry.load("a3", str(tiny_adapters[3]))  # over max_cpu_loras=3: evicts a1, not pinned a0
    assert list(registry._cpu) == ["a0", "a2", "a3"]
    reads = []
    real = reg.read_peft_adapter
    monkeypatch.setattr(reg, "read_peft_adapter", lambda *a, **k: reads.append(a[0]) or real(*a, **k))
    registry.prefetch("a1")  # back from disk, in the caller's thread
    assert reads == ["a1"] and "a1" in registry._cpu and "a0" in registry._cpu
    registry.assign_slots({"a1"})
    assert reads == ["a1"]  # the engine-side slot load found it in memory
    registry.unpin("a0")


def test_a_stacked_slot_outlives_its_cpu_copy(tiny_model_dir, tiny_adapters):
    """GPU layout: a slot is the adapter's own device copy. Dropping the CPU copy (the cache over its budget once
    the adapter's requests end) used to empty the slot too, a scalar write per table for every finished request
    and a reload from disk for its next one (the H200 check: 64 distinct adapters at 0.3x the base)."""
    registry = AdapterRegistry(read_model_config(tiny_model_dir), max_loras=2, max_lora_rank=16,
                               max_cpu_loras=2, dtype=torch.float32, stacked=True)
    for i in range(2):
        registry.load(f"a{i}", str(tiny_adapters[i]))
    registry.pin("a0")
    assert registry.assign_slots({"a0"}) == {"a0": 0} and registry.num_slot_loads == 1
    registry.unpin("a0")
    for i in (2, 3):  # over max_cpu_loras: a1's CPU copy goes, then a0's
        registry.load(f"a{i}", str(tiny_adapters[i]))
    assert "a0" not in registry._cpu
    table = registry.slots.layers[0]["qkv_proj"]
    assert table.host_ranks[0] == 16 and bool(table.a[0].any())  # its device copy stays
    assert registry.assign_slots({"a0"}) == {"a0": 0} and registry.num_slot_loads == 1  # and serves, no reload
    assert "a0" not in registry._cpu  # not read back from disk either
    registry.unload("a0")  # unloading empties the slot
    assert table.host_ranks[0] == 0 and not table.a[0].any()
