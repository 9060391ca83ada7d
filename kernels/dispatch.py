"""Which kernels run: decided once per model (`kernel_config`), from the device, this CPU and the
`LORAPLEX_KERNELS=auto|triton|torch` setting (or `set_backend` / `forced_backend`, read when a model is built).

Forcing Triton on CPU tensors works only under `TRITON_INTERPRET=1`, which is how the tests check the kernels
without a GPU. `use_triton` / `use_cpu_kernel` serve the kernels' own convenience entry points (tests,
benchmarks); models never ask them per call.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from loraplex.kernels import autotune
from loraplex.kernels.autotune import TuneTable

BACKENDS = ("auto", "triton", "torch")
_backend = os.environ.get("LORAPLEX_KERNELS", "auto")


def set_backend(name: str) -> None:
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {name!r}")
    _backend = name


@contextmanager
def forced_backend(name: str):
    """Run a block with one backend forced, then restore whatever was set before."""
    previous = _backend
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(tensor: torch.Tensor) -> bool:
    if _backend == "torch":
        return False
    if _backend == "triton":
        if not triton_available():
            raise RuntimeError("LORAPLEX_KERNELS=triton but triton is not installed")
        if tensor.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 on CPU")
        return True
    return tensor.device.type == "cuda" and triton_available()


def use_cpu_kernel(tensor: torch.Tensor) -> bool:
    """The C kernels (built on first use) on CPU tensors, unless a backend is forced."""
    return _backend == "auto" and tensor.device.type == "cpu"


def backend() -> str:
    return _backend


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
class CpuCaps:
    """What this CPU and our built C library can do, read once when an engine resolves its config."""

    library: bool = False  # the C kernels were built
    native_bf16: bool = False  # AVX512-BF16 or AMX: bf16 matmuls not emulated
    amx: bool = False  # the library has the AMX tile kernels and the OS grants the tiles
    dpbf16: bool = False  # the library has the AVX512-BF16 dot-product kernels
    int8_dot: bool = False  # the library has integer dot products for int8 activations
    f16c: bool = False  # the library converts float16 K/V

    @staticmethod
    def detect() -> "CpuCaps":
        from loraplex.kernels import cpu_kernels

        built = cpu_kernels.library() is not None
        return CpuCaps(built, cpu_kernels.native_bf16(), built and cpu_kernels.amx_supported(),
                       built and cpu_kernels.dpbf16_supported(), built and cpu_kernels.int8_dot_supported(),
                       built and cpu_kernels._f16c())


@dataclass(frozen=True)
class KernelConfig:
    """Which kernels a model runs, decided once before it is built: every fused op and weight format picks
    its implementation from this in `__init__` (or when its weights are processed), never per call.

    backend: "cpu" (our C kernels where they apply), "triton" (CUDA, or forced under TRITON_INTERPRET=1), or
    "native" (PyTorch ops only: `LORAPLEX_KERNELS=torch`, no C compiler, or CUDA without Triton)."""

    backend: str = "native"
    device_type: str = "cpu"
    dtype: torch.dtype = torch.float32
    kv_dtype: torch.dtype = torch.float32
    lora_dtype: torch.dtype = torch.float32
    pack_weights: bool = False
    quantization: str = "none"
    caps: CpuCaps = field(default_factory=CpuCaps)
    tune: TuneTable = field(default_factory=TuneTable)
    prefill_attention: str = "auto"  # CUDA prefill: "triton" (paged), "sdpa", "auto"

    @property
    def stacked_lora(self) -> bool:
        """Adapters copied into stacked device slots (the Triton kernels), else read in place (CPU)."""
        return self.device_type == "cuda" or self.backend == "triton"


def resolve_backend(device: torch.device) -> str:
    """The backend for a model on `device`: the forced one (`LORAPLEX_KERNELS`, `set_backend`), else Triton on
    CUDA and our C kernels on CPU where each is available."""
    from loraplex.kernels import cpu_kernels

    if _backend == "torch":
        return "native"
    if _backend == "triton":
        if not triton_available():
            raise RuntimeError("LORAPLEX_KERNELS=triton but triton is not installed")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 on CPU")
        return "triton"
    if device.type == "cuda":
        return "triton" if triton_available() else "native"
    return "cpu" if cpu_kernels.library() is not None else "native"


def machine(device: torch.device) -> tuple[str, CpuCaps, TuneTable]:
    """The backend for `device`, this CPU's capabilities and the autotune table (measured where our C kernels
    run), read now."""
    backend = resolve_backend(device)
    caps = CpuCaps.detect() if device.type == "cpu" else CpuCaps()
    if backend != "cpu":
        return backend, caps, autotune.DEFAULT
    return backend, caps, autotune.resolve(caps.native_bf16, caps.dpbf16, caps.amx)


def kernel_config(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype | None = None,
                  lora_dtype: torch.dtype | None = None, pack_weights: bool = True, quantization: str = "none",
                  found: tuple[str, CpuCaps, TuneTable] | None = None, prefill_attention: str = "auto") -> KernelConfig:
    """A `KernelConfig` for a model on `device`; `found`: what `machine(device)` returned, if already read."""
    backend, caps, tune = found or machine(device)
    return KernelConfig(backend, device.type, dtype, kv_dtype or dtype, lora_dtype or dtype,
                        pack_weights and device.type == "cpu", quantization, caps, tune, prefill_attention)
