"""A linear layer whose weight format is a method object (`kernels/linear_methods.py`), chosen once when the
layer is built from the model's `KernelConfig`: plain rows, oneDNN-packed, AMX tiles or quantized."""

from __future__ import annotations

import torch
from torch import nn

from loraplex.kernels.dispatch import KernelConfig
from loraplex.kernels.linear_methods import LinearMethod, linear_method


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, kernels: KernelConfig,
                 quantized: tuple[str, int | None] | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.method: LinearMethod = linear_method(kernels, in_features, quantized)
        self.method.create_weights(self, in_features, out_features, bias)
        self.apply_method = self.method.apply

    def process_weights_after_loading(self) -> None:
        """Once, after the last dtype / device move: pack, quantize or tile the loaded weight."""
        self.method.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.apply_method(self, x)

    def dense_weight(self) -> torch.Tensor:
        return self.method.dense_weight(self)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, {self.method.name}"
