"""What differs by device: a CUDA device named with its index and made current per thread, sizing the KV
cache from its memory after a profiling pass (vLLM's `gpu_memory_utilization`), and two checks on a step
(`DeviceAudit`: no tensor created without naming its device; `NoHostSync`: none of the ops a CUDA graph capture
refuses)."""

from __future__ import annotations

import gc
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def normalize_device(device: torch.device | str, index: int | None = None) -> torch.device:
    """`cuda` with its index filled in (`index` where configured, else the current device): tensors report
    `cuda:0`, never `cuda`, and `torch.device("cuda") != torch.device("cuda:0")`, so every comparison with
    the engine's device (the audit's, `.to` short cuts) needs the index."""
    device = torch.device(device)
    if device.type != "cuda" or device.index is not None:
        return device
    return torch.device("cuda", torch.cuda.current_device() if index is None else index)


def select_device(device: torch.device) -> None:
    """Makes `device` CUDA's current device in the calling thread (the runtime keeps one per host thread):
    without it kernels, graphs and streams of a thread default to device 0 whatever `cuda:N` says."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


@dataclass(frozen=True)
class MemorySnapshot:
    """A CUDA device's memory at one moment (bytes), after garbage collection and `empty_cache`: without
    them an engine freed a moment ago (a cycle not yet collected, blocks in torch's cache) counts as used."""

    total: int
    free: int
    torch_reserved: int  # held by this process's caching allocator
    torch_allocated: int  # ... of which live tensors

    @property
    def non_torch(self) -> int:
        """Outside torch's allocator: the CUDA context, cuBLAS / NCCL workspaces, other processes."""
        return self.total - self.free - self.torch_reserved

    @classmethod
    def measure(cls, device: torch.device) -> "MemorySnapshot":
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        return cls(total, free, torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device))


@dataclass(frozen=True)
class DeviceMemory:
    """What the KV sizing reads (bytes), as vLLM's `memory_profiling`: `gpu_memory_utilization` is this
    engine's share of the whole device, and everything but the KV cache comes out of it."""

    total: int
    free_at_start: int  # before the engine loaded anything
    torch_at_start: int  # torch's reservation in this process then (an engine still alive)
    weights: int  # torch's allocations the loading added: weights, adapter slots
    activations: int  # the profiling pass's peak above the weights, its own KV blocks left out
    non_torch: int  # growth outside torch's allocator since the start (cuBLAS workspaces, Triton modules)
    graphs: int = 0  # the decode graphs' pool, captured after sizing (an estimate)

    def requested(self, utilization: float) -> int:
        return int(self.total * utilization)

    def kv_budget(self, utilization: float) -> int:
        return self.requested(utilization) - self.weights - self.activations - self.non_torch - self.graphs

    def describe(self, utilization: float) -> str:
        return (f"{_gib(self.total)} GiB x {utilization} = {_gib(self.requested(utilization))} GiB for this engine: "
                f"weights and adapter slots {_gib(self.weights)} GiB, profiled activations {_gib(self.activations)} "
                f"GiB, outside torch {_gib(self.non_torch)} GiB, decode graphs (estimate) {_gib(self.graphs)} GiB")


def _gib(n: int) -> str:
    return f"{n / 2 ** 30:.2f}"


def kv_blocks_for(memory: DeviceMemory, utilization: float, block_bytes: int) -> int:
    requested = memory.requested(utilization)
    if memory.free_at_start < requested:
        used = memory.total - memory.free_at_start
        raise ValueError(
            f"gpu_memory_utilization={utilization} asks for {_gib(requested)} GiB of {_gib(memory.total)} GiB but only "
            f"{_gib(memory.free_at_start)} GiB was free at start-up: {_gib(used)} GiB in use, "
            f"{_gib(memory.torch_at_start)} GiB of it by torch in this process (an engine still referenced?) and "
            f"{_gib(used - memory.torch_at_start)} GiB outside torch (other processes, the CUDA context); free it "
            "or lower --gpu-memory-utilization")
    budget = memory.kv_budget(utilization)
    if budget < block_bytes:
        raise ValueError(
            f"no memory left for the KV cache ({_gib(budget)} GiB, a block needs {block_bytes} bytes): "
            f"{memory.describe(utilization)}; raise --gpu-memory-utilization or lower --max-num-batched-tokens / "
            "--max-num-seqs / --max-loras")
    return budget // block_bytes


def profile_kv_blocks(max_num_batched_tokens: int, max_model_len: int, block_size: int) -> int:
    """The blocks `model_runner.profile_step` allocates for its own KV (sequences of at most max_model_len
    tokens): freed when it returns, the real cache takes their place, so the peak must not count them."""
    lens = [min(max_model_len, max_num_batched_tokens - start) for start in range(0, max_num_batched_tokens,
                                                                                 max_model_len)]
    return sum(-(-n // block_size) for n in lens)


def profiled_memory(device: torch.device, start: MemorySnapshot, profile: Callable[[], None], profile_kv: int,
                    graph_share: float) -> DeviceMemory:
    """Runs the profiling pass and reads what the engine needs besides its KV cache. `graph_share`: the
    largest captured decode batch over the profiled tokens (0 without graphs); the graphs' pool holds about
    that share of the profiled activations, and it is captured after the KV cache took its memory."""
    loaded = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    profile()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    after = MemorySnapshot.measure(device)
    activations = max(0, peak - loaded - profile_kv)
    return DeviceMemory(start.total, start.free, start.torch_reserved, loaded - start.torch_allocated, activations,
                        max(0, after.non_torch - start.non_torch), int(activations * min(1.0, graph_share)))


ROOT = Path(__file__).resolve().parents[1]  # the repository: loraplex's folders, its tests


def _caller() -> str:
    """The two innermost frames of our own code that led here (folder/file:line), for messages."""
    ours = []
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename)
        if path.is_relative_to(ROOT) and "site-packages" not in path.parts and path != Path(__file__):
            ours.append(f"{path.parent.name}/{path.name}:{frame.lineno}")
    return " <- ".join(ours[:2]) or "?"


class DeviceAuditError(RuntimeError):
    pass


class DeviceAudit(TorchDispatchMode):
    """Inside it, tensors created without a device land on `meta` (a device the engine never
    uses): the first op that makes a tensor on a device other than the engine's or the host
    raises, naming our line that caused it (meta data cannot be read, so going on would only
    fail later, less clearly). Ops that feed a host tensor of more than one element to a device
    op (a hidden, synchronous copy) are collected in `found`. On a CPU engine this still catches
    the bug that breaks a CUDA one: a `torch.tensor(...)` or `torch.arange(...)` without `device=`."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = normalize_device(device)
        self.found: list[str] = []
        self._default = torch.device("meta")

    def __enter__(self):
        self._default.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._default.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if self.device.type != "cpu" and any(t.device == self.device for t in inputs) and \
                any(t.device.type == "cpu" and t.numel() > 1 for t in inputs) and func is not torch.ops.aten.copy_.default:
            self.found.append(f"{func}: a host tensor used by a {self.device} op, at {_caller()}")
        self._check(func, inputs)  # inputs first: a CPU op reads a meta index as garbage, a copy fails
        out = func(*args, **kwargs)
        self._check(func, tree_flatten(out)[0])
        return out

    def _check(self, func, tensors) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device not in (self.device, torch.device("cpu")):
                raise DeviceAuditError(f"{func} on a tensor on {t.device} {tuple(t.shape)} (made without a "
                                       f"device?), at {_caller()}")


SYNCING_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::_unique2",
               "aten::unique_consecutive", "aten::unique_dim", "aten::item", "aten::is_nonzero"}


class CopyFence:
    """The last non-blocking copy out of a reused pinned staging buffer: `wait()` before the host writes the buffer
    again, since until that copy has run the DMA may still read it: a step launched before the previous one's
    tokens were read back (--async-scheduling), or after a step that sampled nothing (a prefill chunk), which
    read nothing back. Nothing to wait for off CUDA, where such copies are synchronous."""

    def __init__(self, device: torch.device) -> None:
        self.event = torch.cuda.Event() if device.type == "cuda" else None

    def record(self) -> None:
        if self.event is not None:
            self.event.record()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class HostSyncError(RuntimeError):
    pass


class NoHostSync(TorchDispatchMode):
    """Refuses what a CUDA graph capture refuses: reading a tensor's values on the host (item,
    int(), bool(), nonzero, boolean masks). Stands in for a capture on CPU."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        boolean_index = name in ("aten::index", "aten::index_put", "aten::index_put_") and any(
            isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in tree_flatten(args[1])[0])
        if name in SYNCING_OPS or boolean_index:
            raise HostSyncError(f"{name} reads device values on the host, at {_caller()}")
        return func(*args, **(kwargs or {}))
