"""The collectives a tensor-parallel rank's layers call, over the worker process's default process group
(gloo on CPU, NCCL on CUDA; `tp_worker.py` starts it). A model built without a shard plan never calls them:
its layers take `identity` once, when they are built."""

from __future__ import annotations

import torch
import torch.distributed as dist


def identity(x: torch.Tensor) -> torch.Tensor:
    return x


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum over ranks of each rank's partial `x` (a row-parallel layer's output), in place."""
    dist.all_reduce(x)
    return x


def all_gather_rows(x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Each rank's `x` [T, sizes[rank]] joined along the last dim in rank order: [T, sum(sizes)]. Runs of unequal
    size are padded to the largest for the collective and cut after."""
    width = max(sizes)
    padded = x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded.contiguous())
    return torch.cat([part[..., :n] for part, n in zip(parts, sizes)], dim=-1)
