"""Tensor parallelism's plan for one rank: which heads, MLP columns, experts and vocabulary rows it holds
(Megatron's split, as vLLM's column- and row-parallel layers make it), as pure data.

- Attention: KV heads split in contiguous runs, each rank's query heads the ones that read its KV heads; with
  fewer KV heads than ranks each KV head is replicated on the ranks that share its query heads. Uneven splits
  are allowed (the default model has 9 query and 3 KV heads): every head is computed whole on one rank.
- q/k/v and gate/up are column-parallel (the rank's output rows of the full weight), o and down row-parallel (its
  input columns), each followed by one all-reduce in the layer.
- The embedding and the head are vocabulary-parallel (rows `vocab`); MoE experts are split in contiguous runs
  (router replicated); a shared expert is split like an MLP.

`local_config` is the model's `ModelConfig` as one rank sees it: its heads and MLP width, the plan in `shard`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from loraplex.platform.models.model_config import ModelConfig


@dataclass(frozen=True)
class ShardPlan:
    """Rank `rank` of `size`, over a model of this geometry (the full model's sizes); its parts are properties."""

    rank: int
    size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_experts: int = 0
    shared_expert_size: int = 0

    def at(self, rank: int) -> "ShardPlan":
        return dataclasses.replace(self, rank=rank)

    def every_rank(self, part: str) -> list[tuple[int, int]]:
        """`part` ("q_heads", "kv_heads", "vocab", ...) of every rank, in rank order."""
        return [getattr(self.at(rank), part) for rank in range(self.size)]

    @property
    def q_heads(self) -> tuple[int, int]:
        """[first, end) of the full model's query heads."""
        return head_split(self.num_heads, self.num_kv_heads, self.size, self.rank)[0]

    @property
    def kv_heads(self) -> tuple[int, int]:
        return head_split(self.num_heads, self.num_kv_heads, self.size, self.rank)[1]

    @property
    def intermediate(self) -> tuple[int, int]:
        """The MLP's columns."""
        return split(self.intermediate_size, self.size, self.rank)

    @property
    def vocab(self) -> tuple[int, int]:
        """Embedding and head rows."""
        return split(self.vocab_size, self.size, self.rank)

    @property
    def experts(self) -> tuple[int, int]:
        return split(self.num_experts, self.size, self.rank)

    @property
    def shared_expert(self) -> tuple[int, int]:
        """A shared expert's columns."""
        return split(self.shared_expert_size, self.size, self.rank)


def split(total: int, size: int, rank: int) -> tuple[int, int]:
    """Rank's contiguous run of `total` items over `size` ranks, as even as can be."""
    return total * rank // size, total * (rank + 1) // size


def head_split(num_heads: int, num_kv_heads: int, size: int, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(query heads, KV heads) of `rank`: see the module's docstring."""
    group = num_heads // num_kv_heads
    if num_kv_heads >= size:
        kv = split(num_kv_heads, size, rank)
        return (kv[0] * group, kv[1] * group), kv
    if size % num_kv_heads or group < size // num_kv_heads:
        raise ValueError(f"tensor_parallel_size {size} does not split {num_heads} query heads over "
                         f"{num_kv_heads} KV heads: with fewer KV heads than ranks, the ranks must be a multiple "
                         "of the KV heads and no more than the query heads")
    per_kv = size // num_kv_heads
    kv, within = divmod(rank, per_kv)
    first, end = split(group, per_kv, within)
    return (kv * group + first, kv * group + end), (kv, kv + 1)


def plan_for(config: ModelConfig, size: int, rank: int) -> ShardPlan:
    """Rank's plan; a model that cannot be split `size` ways is refused, saying why."""
    moe = config.moe
    if moe is not None and moe.num_experts < size:
        raise ValueError(f"tensor_parallel_size {size} is more than the model's {moe.num_experts} experts")
    if min(config.vocab_size, config.intermediate_size) < size or moe is not None and \
            0 < moe.shared_expert_size < size:
        raise ValueError(f"tensor_parallel_size {size} is more than the model can be split in")
    head_split(config.num_heads, config.num_kv_heads, size, rank)  # refuses a split it cannot make
    return ShardPlan(rank, size, config.num_heads, config.num_kv_heads, config.head_dim, config.intermediate_size,
                     config.vocab_size, moe.num_experts if moe is not None else 0,
                     moe.shared_expert_size if moe is not None else 0)


def local_config(config: ModelConfig, plan: ShardPlan) -> ModelConfig:
    """The config one rank builds its layers from: its heads and MLP width (head_dim and scale unchanged)."""
    (q0, q1), (kv0, kv1), (i0, i1) = plan.q_heads, plan.kv_heads, plan.intermediate
    return dataclasses.replace(config, num_heads=q1 - q0, num_kv_heads=kv1 - kv0, intermediate_size=i1 - i0,
                               shard=plan)


def span(first: int, end: int, unit: int = 1, offset: int = 0) -> torch.Tensor:
    """Indices offset + [first * unit, end * unit), on the CPU (models are built under a meta device)."""
    return torch.arange(offset + first * unit, offset + end * unit, dtype=torch.long, device="cpu")


def qkv_rows(plan: ShardPlan) -> torch.Tensor:
    """The rank's rows of the fused q/k/v weight [(H + 2 KV) d, hidden]."""
    d, kv_offset = plan.head_dim, plan.num_heads * plan.head_dim
    return torch.cat([span(*plan.q_heads, d), span(*plan.kv_heads, d, kv_offset),
                      span(*plan.kv_heads, d, kv_offset + plan.num_kv_heads * d)])


def o_cols(plan: ShardPlan) -> torch.Tensor:
    return span(*plan.q_heads, plan.head_dim)


def gate_up_rows(columns: tuple[int, int], total: int) -> torch.Tensor:
    """The rank's rows of a fused gate/up weight [2 I, hidden], `columns` of I = `total`."""
    return torch.cat([span(*columns), span(*columns, offset=total)])


def vocab_rows(plan: ShardPlan) -> torch.Tensor:
    return span(*plan.vocab)


@dataclass(frozen=True)
class WeightShard:
    """Which part of a full checkpoint weight a layer holds: rows (dim 0, column-parallel) or columns (dim 1,
    row-parallel) at `index`."""

    dim: int
    index: torch.Tensor

    def take(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.index_select(self.dim, self.index)


def column(index: torch.Tensor) -> WeightShard:
    return WeightShard(0, index)


def row(index: torch.Tensor) -> WeightShard:
    return WeightShard(1, index)
