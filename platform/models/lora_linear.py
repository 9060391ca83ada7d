"""A linear layer that adds each token's own LoRA delta: y = x W^T + scale[s] (x A[s]^T) B[s]^T.

The weights come from the adapter registry's slots (`adapters/slots.py`): a `LoRATable` per
projection pointing at each resident adapter's own weights; which slot each token uses comes
from the step's `LoRABatch`, shared by every layer through one `LoRAContext`. Shrink and expand
go through `kernels/sgmv.py` (on CPU: the C kernel for decode batches, per-segment GEMMs else;
stacked device slots: the Triton SGMV kernels).
"""

from __future__ import annotations

import torch

from loraplex.kernels.custom_ops import LoRADelta
from loraplex.kernels.dispatch import KernelConfig
from loraplex.kernels.sgmv import LoRABatch, LoRATable, StackedLoRA
from loraplex.platform.models.linear import Linear
from loraplex.platform.models.quantized import projection_format


class LoRAContext:
    """The current step's token -> slot grouping; None when no token uses an adapter."""

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None


class LoRALinear(Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool, context: LoRAContext,
                 kernels: KernelConfig, name: str = "") -> None:
        super().__init__(in_features, out_features, bias, kernels, projection_format(kernels.quantization))
        self.context, self.name = context, name
        self.lora: LoRATable | StackedLoRA | None = None  # set by the model's attach_lora
        self.add_lora = LoRADelta(kernels)  # the layout of `lora` follows the same config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.apply_method(self, x)
        batch, lora = self.context.batch, self.lora
        if batch is None or lora is None:
            return y
        y = self.add_lora(x, lora, batch, y)
        for mix_pass in batch.passes:  # adapter mixes: each token's further (slot, weight) pairs
            y = self.add_lora(x, lora, mix_pass, y)
        return y
