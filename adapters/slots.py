"""Device slots: per layer and fused projection, the stacked LoRA weights of up to `max_loras`
adapters, the layout the SGMV kernels read (design.md section 4).

    A [max_loras, num_slices * max_rank, in]    B [max_loras, sum(out_i), max_rank]
    ranks[slot] (0: this slot does not touch this projection)    scales[slot]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.adapters.peft_format import LoRAWeights, module_shapes
from loraplex.platform.config import ModelConfig

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
         "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


@dataclass
class ProjectionLoRA:
    """What one LoRA-capable linear layer reads each step."""

    a: torch.Tensor
    b: torch.Tensor
    ranks: list[int]
    scales: list[float]
    offsets: list[int]  # output offset of each slice, plus the total

    @property
    def num_slices(self) -> int:
        return len(self.offsets) - 1


class LoRASlots:
    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: str | torch.device = "cpu") -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        shapes = module_shapes(config)
        self.layers: list[dict[str, ProjectionLoRA]] = []
        for _ in range(config.num_layers):
            layer = {}
            for fused, parts in FUSED.items():
                in_f = shapes[parts[0]][0]
                offsets = [0]
                for part in parts:
                    offsets.append(offsets[-1] + shapes[part][1])
                layer[fused] = ProjectionLoRA(
                    a=torch.zeros(max_loras, len(parts) * max_rank, in_f, dtype=dtype, device=device),
                    b=torch.zeros(max_loras, offsets[-1], max_rank, dtype=dtype, device=device),
                    ranks=[0] * max_loras, scales=[0.0] * max_loras, offsets=offsets)
            self.layers.append(layer)

    @torch.no_grad()
    def load(self, slot: int, lora: LoRAWeights) -> None:
        r, R = lora.rank, self.max_rank
        for index, layer in enumerate(self.layers):
            for fused, parts in FUSED.items():
                proj = layer[fused]
                proj.a[slot].zero_()
                proj.b[slot].zero_()
                touched = False
                for i, part in enumerate(parts):
                    pair = lora.weights.get((index, part))
                    if pair is None:
                        continue
                    a, b = pair
                    proj.a[slot, i * R:i * R + r].copy_(a)
                    proj.b[slot, proj.offsets[i]:proj.offsets[i + 1], :r].copy_(b)
                    touched = True
                proj.ranks[slot] = r if touched else 0
                proj.scales[slot] = lora.scaling

    def clear(self, slot: int) -> None:
        for layer in self.layers:
            for proj in layer.values():
                proj.ranks[slot] = 0
