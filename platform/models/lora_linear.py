"""A linear layer that adds each token's own LoRA delta: y = x W^T + scale[s] (x A[s]^T) B[s]^T.

The weights come from the adapter registry's slots (`adapters/slots.py`): a `LoRATable` per
projection pointing at each resident adapter's own weights; which slot each token uses comes
from the step's `LoRABatch`, shared by every layer through one `LoRAContext`. Shrink and expand
go through `kernels/sgmv.py` (on CPU: the C kernel for decode batches, per-segment GEMMs else;
stacked device slots: the Triton SGMV kernels).
"""

from __future__ import annotations

import torch

from loraplex.kernels.sgmv import LoRABatch, LoRATable, StackedLoRA, sgmv_lora_stacked, sgmv_lora_table
from loraplex.platform.models.linear import PackedLinear


class LoRAContext:
    """The current step's token -> slot grouping; None when no token uses an adapter."""

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None


class LoRALinear(PackedLinear):
    def __init__(self, in_features: int, out_features: int, bias: bool, context: LoRAContext) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.context = context
        self.lora: LoRATable | StackedLoRA | None = None  # set by the model's attach_lora

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        batch, lora = self.context.batch, self.lora
        if batch is None or lora is None:
            return y
        if isinstance(lora, StackedLoRA):
            return sgmv_lora_stacked(x, lora, batch, y)
        return sgmv_lora_table(x, lora, batch, y)
