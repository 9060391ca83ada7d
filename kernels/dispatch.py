"""Which kernels run: decided once per model (`kernel_config`), from the device, this CPU and the
`LORAPLEX_KERNELS=auto|triton|torch` setting, read when a config is resolved (`resolve_backend`), never per call.
`KernelConfig` is the only source: every fused op and weight format picks its implementation from one in
`__init__`. Tests and benchmarks build one too (`kernel_config(..., backend=...)` to name the backend) and hand
it to the kernels' entry points, or build the op from it.

Forcing Triton on CPU tensors works only under `TRITON_INTERPRET=1`, which is how the tests check the kernels
without a GPU; it is checked once, when the config is resolved.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import StrEnum

import torch

from loraplex.kernels import autotune, quant
from loraplex.kernels.autotune import TuneTable
from loraplex.kernels.cpu_kernels import CpuCaps

SETTINGS = ("auto", "triton", "torch")  # what LORAPLEX_KERNELS may say


class Backend(StrEnum):
    CPU = "cpu"  # our C kernels where they apply
    TRITON = "triton"  # CUDA, or forced under TRITON_INTERPRET=1
    NATIVE = "native"  # PyTorch ops only: LORAPLEX_KERNELS=torch, no C compiler, or CUDA without Triton


class PrefillAttention(StrEnum):
    """What a layer runs for a CUDA step of fresh prompts: the paged Triton kernel, torch SDPA, or auto."""

    AUTO = "auto"
    TRITON = "triton"
    SDPA = "sdpa"


def kernels_setting() -> str:
    """`LORAPLEX_KERNELS`, read when a config is resolved."""
    setting = os.environ.get("LORAPLEX_KERNELS", "auto")
    if setting not in SETTINGS:
        raise ValueError(f"LORAPLEX_KERNELS must be one of {SETTINGS}, got {setting!r}")
    return setting


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`: through pinned memory and without waiting on CUDA, as is."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def ieee_fp32(dtype: torch.dtype) -> bool:
    """fp32 dots in IEEE precision unless torch itself allows TF32 (off by default), so the
    Triton kernels match the PyTorch path exactly where parity is tested."""
    return dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Triton's CPU interpreter computes bf16 tl.dot wrongly (triton 3.8): there, and only
    there, kernels upcast bf16 tiles before the dot."""
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class KernelConfig:
    """Which kernels a model runs, decided once before it is built: every fused op and weight format picks
    its implementation from this in `__init__` (or when its weights are processed), never per call.

    `backend` and `prefill_attention` may be given as their strings; they are held as their enums."""

    backend: Backend = Backend.NATIVE
    device_type: str = "cpu"
    dtype: torch.dtype = torch.float32
    kv_dtype: torch.dtype = torch.float32
    lora_dtype: torch.dtype = torch.float32
    pack_weights: bool = False
    quantization: str = "none"
    caps: CpuCaps = field(default_factory=CpuCaps)
    tune: TuneTable = field(default_factory=TuneTable)
    prefill_attention: PrefillAttention = PrefillAttention.AUTO
    # --deterministic: every kernel sums a token's values in one order whatever the batch, the step's token
    # count, the prefill chunking or the prefix cache (docs/engine.md, "Deterministic inference")
    deterministic: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "backend", Backend(self.backend))
        object.__setattr__(self, "prefill_attention", PrefillAttention(self.prefill_attention))

    @property
    def stacked_lora(self) -> bool:
        """Adapters copied into stacked device slots (the Triton kernels), else read in place (CPU)."""
        return self.device_type == "cuda" or self.backend == Backend.TRITON


def resolve_backend(device: torch.device, setting: str | None = None) -> Backend:
    """The backend for a model on `device`: the forced one (`setting`, else `LORAPLEX_KERNELS`), else Triton on
    CUDA and our C kernels on CPU where each is available."""
    from loraplex.kernels import cpu_kernels

    setting = setting or kernels_setting()
    if setting == "torch":
        return Backend.NATIVE
    if setting == "triton":
        return checked_backend(device, Backend.TRITON)
    if device.type == "cuda":
        return Backend.TRITON if triton_available() else Backend.NATIVE
    return Backend.CPU if cpu_kernels.library() is not None else Backend.NATIVE


def checked_backend(device: torch.device, backend: Backend | str) -> Backend:
    """`backend`, named by a test, a benchmark or `LORAPLEX_KERNELS`, if it can run on `device`."""
    from loraplex.kernels import cpu_kernels

    backend = Backend(backend)
    if backend == Backend.TRITON:
        if not triton_available():
            raise RuntimeError("the Triton backend needs triton, which is not installed")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 on CPU")
    elif backend == Backend.CPU and device.type != "cpu":
        raise RuntimeError(f"our C kernels run on CPU tensors, not on {device}")
    elif backend == Backend.CPU and cpu_kernels.library() is None:
        raise RuntimeError("our C kernels were not built here (no C compiler)")
    return backend


def machine(device: torch.device, backend: Backend | str | None = None) -> tuple[Backend, CpuCaps, TuneTable]:
    """The backend for `device` (`backend` if named, checked; else resolved), this CPU's capabilities and the
    autotune table (measured where our C kernels run), read now."""
    backend = resolve_backend(device) if backend is None else checked_backend(device, backend)
    caps = CpuCaps.detect() if device.type == "cpu" else CpuCaps()
    if backend != Backend.CPU:
        return backend, caps, autotune.DEFAULT
    return backend, caps, autotune.resolve(caps.native_bf16, caps.dpbf16, caps.amx,
                                           kernel_seconds=quant.kernel_seconds)


def kernel_config(device: torch.device | str, dtype: torch.dtype, kv_dtype: torch.dtype | None = None,
                  lora_dtype: torch.dtype | None = None, pack_weights: bool = True, quantization: str = "none",
                  found: tuple[Backend, CpuCaps, TuneTable] | None = None,
                  prefill_attention: PrefillAttention | str = PrefillAttention.AUTO,
                  backend: Backend | str | None = None, deterministic: bool = False) -> KernelConfig:
    """A `KernelConfig` for a model on `device`; `found`: what `machine(device)` returned, if already read;
    `backend`: this backend rather than the one the machine resolves (tests and benchmarks; checked the same way
    as `LORAPLEX_KERNELS=triton`)."""
    if found is not None and backend is not None:
        raise ValueError("kernel_config takes a backend found by `machine` or one named, not both")
    device = torch.device(device)
    backend, caps, tune = found or machine(device, backend)
    return KernelConfig(backend, device.type, dtype, kv_dtype or dtype, lora_dtype or dtype,
                        pack_weights and device.type == "cpu", quantization, caps, tune,
                        PrefillAttention(prefill_attention), deterministic)
