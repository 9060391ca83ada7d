"""Slots: which adapters one batch may use, per layer and fused projection (design.md section 4).

On the CPU a slot is a pointer, not a copy: `load` points each projection's `LoRATable` entry at
the adapter's own compact weights (`LoRAWeights.projections`, in its own rank), which the
multi-LoRA kernels read in place. Loading a slot costs microseconds, so `max_loras` is bounded
by memory (how many adapters may be resident at once), not by copy time.
"""

from __future__ import annotations

import torch

from loraplex.adapters.peft_format import LoRAWeights, fused_offsets, module_shapes
from loraplex.kernels.sgmv import LoRATable
from loraplex.platform.config import ModelConfig
from loraplex.platform.models import FUSED_PROJECTIONS


class LoRASlots:
    def __init__(self, config: ModelConfig, max_loras: int, dtype: torch.dtype) -> None:
        self.max_loras = max_loras
        shapes = module_shapes(config)
        self.layers: list[dict[str, LoRATable]] = [
            {fused: LoRATable.empty(max_loras, fused_offsets(fused, shapes), dtype) for fused in FUSED_PROJECTIONS}
            for _ in range(config.num_layers)]

    def load(self, slot: int, lora: LoRAWeights) -> None:
        for index, layer in enumerate(self.layers):
            for fused, table in layer.items():
                pair = lora.projections.get((index, fused))
                if pair is None:
                    table.clear(slot)
                else:
                    table.set(slot, pair[0], pair[1], lora.scaling)

    def clear(self, slot: int) -> None:
        for layer in self.layers:
            for table in layer.values():
                table.clear(slot)
