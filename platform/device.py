"""What differs by device: sizing the KV cache from a CUDA device's memory after a profiling
pass, and two checks on a step (`DeviceAudit`: no tensor created without naming its device;
`NoHostSync`: none of the ops a CUDA graph capture refuses)."""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


@dataclass(frozen=True)
class DeviceMemory:
    """A CUDA device's memory as the KV sizing sees it (bytes)."""

    total: int
    used_before: int  # held before the engine loaded anything: other processes, the CUDA context
    peak_torch: int  # torch's peak in the profiling pass: weights, adapter slots, activations

    def kv_budget(self, utilization: float) -> int:
        """vLLM's `gpu_memory_utilization`: the engine may hold `utilization` of the whole
        device; the KV cache gets what the profiled peak and what was held before leave."""
        return int(self.total * utilization) - self.used_before - self.peak_torch


def kv_blocks_for(memory: DeviceMemory, utilization: float, block_bytes: int) -> int:
    budget = memory.kv_budget(utilization)
    if budget < block_bytes:
        gib = 2 ** 30
        raise ValueError(
            f"no memory left for the KV cache: gpu_memory_utilization={utilization} of {memory.total / gib:.1f} GiB "
            f"is {memory.total * utilization / gib:.2f} GiB, of which {memory.used_before / gib:.2f} GiB was in use "
            f"before start-up and the profiling pass peaked at {memory.peak_torch / gib:.2f} GiB (weights, adapters, "
            f"activations); raise --gpu-memory-utilization or lower --max-num-batched-tokens / --max-loras")
    return budget // block_bytes


def cuda_used_bytes(device: torch.device) -> tuple[int, int]:
    """(total, in use) of a CUDA device right now, whoever holds it."""
    free, total = torch.cuda.mem_get_info(device)
    return total, total - free


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
        self.device = torch.device(device)
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
