"""A linear layer whose weight format is a method object (`kernels/linear_methods.py`), chosen once when the
layer is built from the model's `KernelConfig`: plain rows, oneDNN-packed, AMX tiles or quantized."""

from __future__ import annotations

import torch
from torch import nn

from loraplex.kernels.dispatch import KernelConfig
from loraplex.kernels.linear_methods import LinearMethod, linear_method
from loraplex.platform.models.sharding import WeightShard


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, kernels: KernelConfig,
                 quantized: tuple[str, int | None] | None = None, shard: WeightShard | None = None) -> None:
        """`shard`: under tensor parallelism, the part of the checkpoint's full weight this rank holds (its rows
        or columns; `in_features` / `out_features` are that part's)."""
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.shard = shard
        self.method: LinearMethod = linear_method(kernels, in_features, quantized)
        self.method.create_weights(self, in_features, out_features, bias)
        self.apply_method = self.method.apply

    @torch.no_grad()
    def weight_loader(self, weight: torch.Tensor, quantized=None) -> None:
        """A checkpoint's weight (the full one: a shard takes its part), through the format (`quantized`: bits
        the checkpoint holds for it)."""
        if self.shard is not None:
            if quantized is not None:
                raise ValueError("quantized bits are not sharded: tensor parallelism serves float weights")
            weight = self.shard.take(weight)
        self.method.load(self, weight, quantized)

    def shard_bias(self, bias: torch.Tensor) -> torch.Tensor:
        """A checkpoint's full bias as this layer holds it (a column-parallel layer's rows)."""
        return bias if self.shard is None else self.shard.take(bias)

    def process_weights_after_loading(self) -> None:
        """Once, after the last dtype / device move: pack, quantize or tile the loaded weight."""
        self.method.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.apply_method(self, x)

    def dense_weight(self) -> torch.Tensor:
        return self.method.dense_weight(self)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows of the weight where the format holds a tied table (its tiles) with no copy of its own."""
        return self.method.rows(self, index)

    def served(self, weight: torch.Tensor) -> torch.Tensor:
        """A float weight as this layer's format would serve it (quantized: rounded)."""
        return self.method.served(weight)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, {self.method.name}"
