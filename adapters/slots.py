"""Slots: which adapters one batch may use, per layer and fused projection (design.md section 4).

On the CPU a slot is a pointer, not a copy: `load` points each projection's `LoRATable` entry at
the adapter's own compact weights (`LoRAWeights.projections`, in its own rank), which the
multi-LoRA kernels read in place. Loading a slot costs microseconds, so `max_loras` is bounded
by memory (how many adapters may be resident at once), not by copy time.

Where the Triton kernels run (CUDA, or forced with `LORAPLEX_KERNELS=triton`), a slot is a copy:
each projection is a `StackedLoRA`, persistent device tensors the adapter is copied into (padded
to `max_lora_rank`), so a step reads adapters with no per-step allocation or host copy.
"""

from __future__ import annotations

import torch

from loraplex.adapters.peft_format import LoRAWeights, fused_offsets, module_shapes
from loraplex.kernels.sgmv import LoRATable, StackedLoRA
from loraplex.platform.config import ModelConfig
from loraplex.platform.models import FUSED_PROJECTIONS


class LoRASlots:
    def __init__(self, config: ModelConfig, max_loras: int, dtype: torch.dtype, device: torch.device | None = None,
                 max_rank: int | None = None) -> None:
        """`max_rank` given: the stacked layout on `device`; else tables pointing in place (CPU)."""
        self.max_loras = max_loras
        self.stacked = max_rank is not None
        shapes = module_shapes(config)

        def table(fused: str) -> LoRATable | StackedLoRA:
            offsets = fused_offsets(fused, shapes)
            if not self.stacked:
                return LoRATable.empty(max_loras, offsets, dtype)
            return StackedLoRA.empty(max_loras, offsets, shapes[FUSED_PROJECTIONS[fused][0]][0], max_rank, dtype,
                                     device or torch.device("cpu"))

        self.layers: list[dict[str, LoRATable | StackedLoRA]] = [
            {fused: table(fused) for fused in FUSED_PROJECTIONS} for _ in range(config.num_layers)]

    @property
    def null_slot(self) -> int | None:
        """The slot index of tokens without an adapter in a stacked batch (rank 0), else None."""
        return self.max_loras if self.stacked else None

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
