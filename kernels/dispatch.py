"""Which implementation a kernel call takes: Triton on CUDA tensors, the PyTorch path on CPU.

`LORAPLEX_KERNELS=triton|torch` (or `set_backend` / `forced_backend`) forces one. Forcing Triton on CPU tensors
works only under `TRITON_INTERPRET=1`, which is how the tests check the kernels without a GPU.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch

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
