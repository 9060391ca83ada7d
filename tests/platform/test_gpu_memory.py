"""The CUDA path without a GPU: KV sizing from faked device memory readings (vLLM's formula), device
indices filled in, the device made current in the threads that use it, loading in the target dtype."""

from __future__ import annotations

import dataclasses
import gc
import threading
import weakref

import pytest
import torch

from loraplex.platform.device import (DeviceAudit, DeviceMemory, MemorySnapshot, kv_blocks_for, normalize_device,
                                      profile_kv_blocks, profiled_memory, select_device)

GIB = 2 ** 30
CUDA = torch.device("cuda", 0)


class FakeCuda:
    """A CUDA device's readings as torch's caching allocator gives them: freed tensors stay reserved (cached)
    until `empty_cache`; `others` is memory outside torch (CUDA context, other processes)."""

    def __init__(self, total: int, others: int) -> None:
        self.total, self.others = total, others
        self.allocated = self.reserved = self.peak = 0
        self.calls: list[str] = []

    def install(self, monkeypatch) -> "FakeCuda":
        for name in ("mem_get_info", "memory_allocated", "memory_reserved", "max_memory_allocated",
                     "reset_peak_memory_stats", "empty_cache", "synchronize"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        return self

    def alloc(self, n: int) -> None:
        self.allocated += n
        self.reserved = max(self.reserved, self.allocated)
        self.peak = max(self.peak, self.allocated)

    def free(self, n: int) -> None:
        self.allocated -= n  # stays reserved: the caching allocator keeps it

    def mem_get_info(self, device=None) -> tuple[int, int]:
        return self.total - self.reserved - self.others, self.total

    def memory_allocated(self, device=None) -> int:
        return self.allocated

    def memory_reserved(self, device=None) -> int:
        return self.reserved

    def max_memory_allocated(self, device=None) -> int:
        return self.peak

    def reset_peak_memory_stats(self, device=None) -> None:
        self.peak = self.allocated

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")
        self.reserved = self.allocated

    def synchronize(self, device=None) -> None:
        pass


class _Cycle:
    """An engine dropped by its owner but caught in a reference cycle: its memory comes back only when
    the garbage collector runs."""

    def __init__(self, cuda: FakeCuda, nbytes: int) -> None:
        cuda.alloc(nbytes)
        self.me = self
        weakref.finalize(self, cuda.free, nbytes)


@pytest.fixture
def no_auto_gc():
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def test_a_dropped_engine_does_not_count_as_used(monkeypatch, no_auto_gc):
    """The second `LLM` of a process: the first one's KV (60 GiB) is garbage in a cycle and then cached by
    torch's allocator; the snapshot collects and empties the cache first, so the new engine gets the device."""
    cuda = FakeCuda(80 * GIB, others=GIB // 2).install(monkeypatch)
    _Cycle(cuda, 60 * GIB)
    start = MemorySnapshot.measure(CUDA)
    assert start.free == 80 * GIB - GIB // 2 and start.torch_reserved == 0 and cuda.calls == ["empty_cache"]
    cuda.alloc(2 * GIB)  # the new engine's weights
    memory = profiled_memory(CUDA, start, lambda: (cuda.alloc(GIB), cuda.free(GIB)), 0, 0.0)
    assert kv_blocks_for(memory, 0.9, GIB) == (int(72 * GIB) - 3 * GIB) // GIB


def test_no_room_says_how_much_is_used_and_by_what(monkeypatch):
    cuda = FakeCuda(80 * GIB, others=10 * GIB).install(monkeypatch)
    cuda.alloc(20 * GIB)  # an engine still referenced
    start = MemorySnapshot.measure(CUDA)
    memory = profiled_memory(CUDA, start, lambda: None, 0, 0.0)
    with pytest.raises(ValueError, match=r"only 50.00 GiB was free at start-up: 30.00 GiB in use, 20.00 GiB of it "
                                         r"by torch in this process .* 10.00 GiB outside torch"):
        kv_blocks_for(memory, 0.9, GIB)
    tight = DeviceMemory(80 * GIB, 79 * GIB, 0, weights=60 * GIB, activations=10 * GIB, non_torch=GIB)
    with pytest.raises(ValueError, match=r"no memory left for the KV cache \(-3.00 GiB.*weights and adapter slots "
                                         r"60.00 GiB, profiled activations 10.00 GiB, outside torch 1.00 GiB"):
        kv_blocks_for(tight, 0.85, GIB)


def test_kv_blocks_follow_vllms_formula(monkeypatch):
    """requested = total x utilization; minus weights, the profiled activations (not the profiling pass's
    own KV blocks), what grew outside torch's allocator, and the decode graphs' pool estimate."""
    cuda = FakeCuda(80 * GIB, others=GIB).install(monkeypatch)
    start = MemorySnapshot.measure(CUDA)
    cuda.alloc(16 * GIB)  # weights

    def profile() -> None:
        cuda.alloc(3 * GIB)  # the pass's own KV blocks
        cuda.alloc(4 * GIB)  # activations
        cuda.others += GIB // 2  # cuBLAS workspace, Triton modules: outside torch
        cuda.free(7 * GIB)

    memory = profiled_memory(CUDA, start, profile, 3 * GIB, graph_share=0.25)
    assert (memory.weights, memory.activations, memory.non_torch, memory.graphs) == (16 * GIB, 4 * GIB, GIB // 2,
                                                                                        GIB)
    block = 2 << 20
    expected = (int(80 * GIB * 0.9) - 16 * GIB - 4 * GIB - GIB // 2 - GIB) // block
    assert kv_blocks_for(memory, 0.9, block) == expected


def test_the_engine_sizes_its_kv_with_the_formula(tiny_model_dir, monkeypatch):
    """`Worker.kv_blocks` wired to the readings: graphs reserved unless eager."""
    from loraplex.platform import LLM
    from loraplex.platform.worker import worker as worker_mod
    from loraplex.platform.worker.cuda_graphs import capture_sizes
    from loraplex.platform.worker.model_runner import kv_bytes_per_block

    engine = LLM(str(tiny_model_dir), device="cpu", dtype="float32", num_kv_blocks=16, max_num_seqs=24,
                 max_num_batched_tokens=96).engine
    cuda = FakeCuda(GIB, others=GIB // 16).install(monkeypatch)
    start = MemorySnapshot.measure(CUDA)
    cuda.alloc(GIB // 4)
    config = engine.config
    block = kv_bytes_per_block(engine.model_config, config.block_size, config.torch_kv_dtype)
    profile_kv = profile_kv_blocks(96, engine.max_model_len, config.block_size) * block
    real_profile = worker_mod.profile_step

    def profile_step(*args) -> None:
        real_profile(*args)
        cuda.alloc(profile_kv + GIB // 16)
        cuda.free(profile_kv + GIB // 16)

    monkeypatch.setattr(worker_mod, "profile_step", profile_step)
    activations, share = GIB // 16, capture_sizes(24)[-1] / 96
    for eager, graphs in ((True, 0), (False, int(activations * share))):
        worker = engine.core.executor.worker
        worker.engine_config, worker.memory_start = dataclasses.replace(config, enforce_eager=eager), start
        expected = (int(GIB * config.gpu_memory_utilization) - GIB // 4 - activations - graphs) // block
        assert worker.kv_blocks() == expected


def test_profile_kv_blocks_are_what_the_profiling_pass_allocates(tiny_model_dir, monkeypatch):
    from loraplex.platform import LLM
    from loraplex.platform.worker.model_runner import profile_step

    engine = LLM(str(tiny_model_dir), device="cpu", dtype="float32", num_kv_blocks=16).engine
    shapes, zeros = [], torch.zeros

    def recording_zeros(*size, **kwargs):
        shapes.append(size)
        return zeros(*size, **kwargs)

    monkeypatch.setattr(torch, "zeros", recording_zeros)
    for tokens, max_len in ((1200, 512), (100, 512), (33, 16)):
        shapes.clear()
        profile_step(engine.core.executor.worker.model, engine.model_config, torch.float32, 16, tokens, max_len, 4, engine.device)
        assert shapes[0][2] == profile_kv_blocks(tokens, max_len, 16)


def test_cuda_without_an_index_gets_the_current_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert normalize_device("cuda") == torch.device("cuda", 3)
    assert normalize_device(torch.device("cuda"), index=1) == torch.device("cuda", 1)
    assert normalize_device("cuda:2") == torch.device("cuda", 2)
    assert normalize_device("cpu") == torch.device("cpu")
    assert DeviceAudit(torch.device("cuda")).device == torch.device("cuda", 3)


def test_the_audit_of_cuda_sees_tensors_on_cuda_0(monkeypatch):
    """Fake tensors on cuda:0 (no GPU needed): the audit of plain `cuda` neither raises on them nor misses a
    host tensor fed to their ops."""
    from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError, FakeTensorMode

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.ones(4, 3, device="cuda:0")
        host = torch.ones(3, 2, device="cpu")
        with DeviceAudit(torch.device("cuda")) as audit:
            x * 2
            with pytest.raises(FakeTensorDeviceMismatchError):
                torch.mm(x, host)
    assert len(audit.found) == 1 and "host tensor used by a cuda:0 op" in audit.found[0]


def test_resolve_fills_in_the_index(tiny_model_dir, monkeypatch):
    """The resolved device is what the engine compares tensors with: `cuda` comes back as `cuda:N`."""
    from loraplex.platform import resolve as resolve_mod

    seen = []
    monkeypatch.setattr(resolve_mod, "normalize_device", lambda d: seen.append(d) or torch.device("cpu"))
    resolve_mod.resolve(resolve_mod.EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32"))
    assert seen == [torch.device("cpu")]


def test_select_device_sets_cuda_only(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    select_device(torch.device("cpu"))
    select_device(torch.device("cuda", 2))
    assert calls == [torch.device("cuda", 2)]


def test_the_engine_thread_makes_its_device_current(tiny_model_dir, monkeypatch):
    """`--device cuda:N`: the thread that runs the steps sets N before its first step (the CUDA runtime's
    current device is per thread; the default is 0)."""
    from loraplex.platform import LLM, SamplingParams
    from loraplex.platform.engine.async_engine import AsyncEngine

    engine = LLM(str(tiny_model_dir), device="cpu", dtype="float32", num_kv_blocks=16).engine
    calls, step_threads = [], []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append((d, threading.current_thread().name)))
    engine.device = torch.device("cuda", 1)  # what the engine was built on; the steps run on CPU here
    real_step = engine.step
    monkeypatch.setattr(engine, "step", lambda: step_threads.append(threading.current_thread().name) or real_step())
    client = AsyncEngine(engine)
    try:
        outputs = list(client.stream(client.submit({"prompt_token_ids": [5, 6, 7]},
                                                   SamplingParams(temperature=0, max_tokens=2)), timeout=60))
    finally:
        client.shutdown()
    assert outputs and calls == [(torch.device("cuda", 1), "loraplex-engine")]
    assert set(step_threads) == {"loraplex-engine"}


def _peak_bytes_allocated(fn) -> tuple[object, int]:
    """What `fn` returns and the most bytes it held at once on the host (the profiler's allocation and free
    events in order; ops are credited with what they allocated net of what they freed)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    held = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        held += event.self_cpu_memory_usage
        peak = max(peak, held)
    return result, peak


def _tiny_bf16_checkpoint(tmp_path):
    from conftest import make_tiny_model
    from safetensors.torch import load_file, save_file

    folder = make_tiny_model(tmp_path / "m", hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                             max_position_embeddings=128)
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(folder / "model.safetensors").items()}
    save_file(tensors, folder / "model.safetensors")
    return folder


def test_a_bf16_load_never_holds_a_float32_copy(tmp_path, monkeypatch):
    """Built in the target dtype on the target device: the peak while loading stays near the final weights
    (a float32 model converted after would hold 2x, then 3x during the conversion)."""
    from loraplex.platform.config import EngineConfig
    from loraplex.platform.models import llama
    from loraplex.platform.resolve import resolve

    folder = _tiny_bf16_checkpoint(tmp_path)
    resolved = resolve(EngineConfig(model=str(folder), device="cpu", dtype="bfloat16", pack_weights=False))
    checkpoint = llama._read_safetensors(folder)  # read before: the checkpoint's own bytes are not the model's
    monkeypatch.setattr(llama, "_read_safetensors", lambda _: dict(checkpoint))
    model, peak = _peak_bytes_allocated(lambda: llama.load_model(folder, resolved.model, resolved.kernels, 128))
    final = sum(t.nbytes for t in [*model.parameters(), *model.buffers()] if t is not None)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert peak <= 1.2 * final, f"peak {peak} bytes while loading {final} bytes of weights"

    ref_kernels = dataclasses.replace(resolved.kernels, dtype=torch.float32)
    reference = llama.load_model(folder, resolved.model, ref_kernels, 128).to(torch.bfloat16)
    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_the_engine_selects_its_device_before_loading(tiny_model_dir, monkeypatch):
    from loraplex.platform.config import EngineConfig
    from loraplex.platform.engine.llm_engine import Engine
    from loraplex.platform.worker import worker as worker_mod

    order = []
    real_load = worker_mod.load_model
    monkeypatch.setattr(worker_mod, "select_device", lambda d: order.append(("select", d)))
    monkeypatch.setattr(worker_mod, "load_model", lambda *a: order.append(("load", a[-1])) or real_load(*a))
    Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32", num_kv_blocks=16))
    assert order == [("select", torch.device("cpu")), ("load", torch.device("cpu"))]
