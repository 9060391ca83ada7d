"""The collectives a tensor-parallel rank's layers call, over the worker process's default process group
(gloo on CPU, NCCL on CUDA; `tp_worker.py` starts it). A model built without a shard plan never calls them:
its layers take `identity` once, when they are built.

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
    """float32 all-reduce through a segment every rank maps (a file in /dev/shm, unlinked once all have it)."""

    def __init__(self, segment: torch.Tensor, rank: int, world: int, chunk: int) -> None:
        from loraplex.kernels.cpu_kernels import ops

        self.segment, self.rank, self.world, self.chunk, self.ops = segment, rank, world, chunk, ops
        self.flags = segment.data_ptr()
        self.slots = self.flags + FLAG_BYTES * world
        self.seq = torch.zeros(1, dtype=torch.int64)  # the last sequence number used (the same on every rank)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or not x.is_contiguous():  # no layer hands one over; kept correct anyway
            return _gloo_all_reduce(x)
        self.ops.shm_all_reduce_f32(x, x.numel(), self.flags, self.slots, self.rank, self.world, self.chunk, self.seq)
        return x


def use_shared_memory(name: str, rank: int, world: int, chunk: int = CHUNK) -> None:
    """Every rank maps the segment `name` (rank 0 creates it; the group's barriers order the steps) and from now
    on all-reduces float32 through it."""
    global _reduce
    folder = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    path, size = folder / name, FLAG_BYTES * world + 2 * world * chunk * 4
    if rank == 0:
        with open(path, "wb") as f:
            f.truncate(size)  # zeros: every flag at sequence 0
    dist.barrier()
    segment = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
    dist.barrier()
    if rank == 0:
        os.unlink(path)  # the mappings stay; nothing is left behind if a rank dies
    _reduce = SharedMemoryAllReduce(segment, rank, world, chunk)
