import threading

import pytest
import torch

from loraplex.adapters.peft_format import AdapterError
from loraplex.adapters.registry import AdapterInUseError, AdapterRegistry, UnknownAdapterError
from loraplex.platform.config import ModelConfig


@pytest.fixture
def registry(tiny_model_dir):
    return AdapterRegistry(ModelConfig.from_folder(tiny_model_dir), max_loras=2, max_lora_rank=16,
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


def test_slots_are_reused_lru_and_cpu_cache_is_bounded(registry, tiny_adapters):
    for i in range(5):
        registry.load(f"a{i}", str(tiny_adapters[i]))
    assert list(registry._cpu) == ["a2", "a3", "a4"]  # max_cpu_loras=3
    assert registry.assign_slots({"a0", "a1"}) == {"a0": 0, "a1": 1}  # a0, a1 re-read from disk
    assert registry.assign_slots({"a1"}) == {"a1": 1} and registry.num_slot_loads == 2
    assert registry.assign_slots({"a1", "a2"}) == {"a1": 1, "a2": 0}  # evicts a0, the LRU slot
    slots = registry.slots
    proj = slots.layers[0]["qkv_proj"]
    assert proj.ranks == [16, 8] and proj.scales == [2.0, 2.0]  # a2: rank 16 in slot 0, a1: rank 8
    a, b = registry._weights(registry.get("a1")).weights[(0, "k_proj")]
    assert torch.equal(proj.a[1, 16:24], a) and torch.equal(proj.b[1, 64:96, :8], b)  # k: 2nd slice
    assert proj.a[1, 24:32].abs().sum() == 0 and proj.b[1, :, 8:].abs().sum() == 0  # zero beyond rank
    with pytest.raises(RuntimeError, match="max_loras"):
        registry.assign_slots({"a1", "a2", "a3"})


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
