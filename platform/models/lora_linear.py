"""A linear layer that adds each token's own LoRA delta: y = x W^T + scale[s] (x A[s]^T) B[s]^T.

The stacked weights come from the adapter registry's device slots (`adapters/slots.py`); which
slot each token uses comes from the step's `LoRABatch`, shared by every layer through one
`LoRAContext`. Shrink and expand go through `kernels/sgmv.py` (Triton on CUDA, a fused PyTorch path on CPU).
"""

from __future__ import annotations

import torch

from loraplex.kernels.sgmv import LoRABatch, sgmv_lora
from loraplex.platform.models.linear import PackedLinear


class LoRAContext:
    """The current step's token -> slot grouping; None when no token uses an adapter."""

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None


class LoRALinear(PackedLinear):
    def __init__(self, in_features: int, out_features: int, bias: bool, context: LoRAContext) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.context = context
        self.lora = None  # a ProjectionLoRA once adapters are enabled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        batch, lora = self.context.batch, self.lora
        if batch is None or lora is None:
            return y
        return sgmv_lora(x, lora.a, lora.b, lora.ranks, lora.scales, batch, y, lora.offsets)
