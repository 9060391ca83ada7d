"""The collectives a tensor-parallel rank's layers call, over the worker process's default process group
(gloo on CPU, NCCL on CUDA; `platform/worker/worker.py`'s `worker_main` starts it). A model built without a
shard plan never calls them: its layers take `identity` once, when they are built.

On the CPU the all-reduce of float32 activations goes through a shared-memory segment instead of gloo
(`use_shared_memory`, the C kernel in `kernels/csrc/shm_reduce.c`): gloo's loopback TCP costs a process wake-up
per call, tens of times the bytes' cost at a decode step's sizes (BENCHMARKS.md, tensor parallelism)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

CHUNK = 1 << 18  # floats per rank and buffer of the shared segment (1 MiB): larger tensors go in chunks
FLAG_BYTES = 64  # one cache line per rank's flag


def identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _gloo_all_reduce(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x)
    return x


_reduce = _gloo_all_reduce  # set once per process, by `use_shared_memory`


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum over ranks of each rank's partial `x` (a row-parallel layer's output), in place."""
    return _reduce(x)


def all_gather_rows(x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Each rank's `x` [T, sizes[rank]] joined along the last dim in rank order: [T, sum(sizes)]. Runs of unequal
    size are padded to the largest for the collective and cut after."""
    width = max(sizes)
    padded = x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded.contiguous())
    return torch.cat([part[..., :n] for part, n in zip(parts, sizes)], dim=-1)


class SharedMemoryAllReduce:
    """float32 all-reduce through a segment every rank maps (`create_segment`'s file). The layers hand it their
    float32 outputs, contiguous; the checked kernel call refuses anything else."""

    def __init__(self, segment: torch.Tensor, rank: int, world: int, chunk: int) -> None:
        from loraplex.kernels.cpu_kernels import ops

        self.segment, self.rank, self.world, self.chunk, self.ops = segment, rank, world, chunk, ops
        self.flags = segment.data_ptr()
        self.slots = self.flags + FLAG_BYTES * world
        self.seq = torch.zeros(1, dtype=torch.int64)  # the last sequence number used (the same on every rank)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.ops.shm_all_reduce_f32(x, x.numel(), self.flags, self.slots, self.rank, self.world, self.chunk, self.seq)
        return x


def segment_size(world: int, chunk: int = CHUNK) -> int:
    return FLAG_BYTES * world + 2 * world * chunk * 4


def create_segment(name: str, world: int, chunk: int = CHUNK) -> Path:
    """The engine's: a new file of zeros (every flag at sequence 0) in /dev/shm, readable by this user only, never
    an existing file or a link; the engine unlinks it once every rank has mapped it."""
    folder = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    path = folder / name
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        os.ftruncate(fd, segment_size(world, chunk))
    finally:
        os.close(fd)
    return path


def use_shared_memory(path: str, rank: int, world: int, chunk: int = CHUNK) -> None:
    """Map the engine's segment; from now on this rank all-reduces float32 through it (every rank does, or none:
    the engine decides)."""
    global _reduce
    segment = torch.from_file(path, shared=True, size=segment_size(world, chunk), dtype=torch.uint8)
    _reduce = SharedMemoryAllReduce(segment, rank, world, chunk)
