"""A linear layer that adds each token's own LoRA delta: y = x W^T + scale[s] (x A[s]^T) B[s]^T.

The stacked weights come from the adapter registry's device slots (`adapters/slots.py`); which
slot each token uses comes from the step's `LoRABatch`, shared by every layer through one
`LoRAContext`. Shrink and expand go through `kernels/sgmv.py` (Triton on CUDA, PyTorch on CPU).
"""

from __future__ import annotations

import torch
from torch import nn

from loraplex.kernels.sgmv import LoRABatch, sgmv_expand, sgmv_shrink


class LoRAContext:
    """The current step's token -> slot grouping; None when no token uses an adapter."""

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None


class LoRALinear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool, context: LoRAContext) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.context = context
        self.lora = None  # a ProjectionLoRA once adapters are enabled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        batch, lora = self.context.batch, self.lora
        if batch is None or lora is None:
            return y
        h = torch.zeros(x.shape[0], lora.a.shape[1], dtype=torch.float32, device=x.device)
        sgmv_shrink(x, lora.a, lora.ranks, batch, h, lora.num_slices)
        return sgmv_expand(h, lora.b, lora.ranks, lora.scales, batch, y, lora.offsets)
