"""Random multi-LoRA cases in the stacked layout (what the Triton kernels and the references
read) and the same adapters as a `LoRATable` (what the CPU path reads in place)."""

import torch

from loraplex.kernels.lora_batch import LoRABatch
from loraplex.kernels.sgmv import LoRATable, sgmv_expand_reference, sgmv_shrink_reference


def lora_case(seed, num_tokens, num_slots, max_rank, in_features, widths, dtype=torch.float32, none_frac=0.2,
              min_rank=1, rank_choices=None):
    g = torch.Generator().manual_seed(seed)
    slots = torch.randint(0, num_slots, (num_tokens,), generator=g)
    slots[torch.rand(num_tokens, generator=g) < none_frac] = -1
    ranks = [int(r) for r in torch.randint(min_rank, max_rank + 1, (num_slots,), generator=g)] \
        if rank_choices is None else [rank_choices[i % len(rank_choices)] for i in range(num_slots)]
    x = torch.randn(num_tokens, in_features, generator=g).to(dtype)
    a = (torch.randn(num_slots, len(widths) * max_rank, in_features, generator=g) / in_features ** 0.5).to(dtype)
    b = (torch.randn(num_slots, sum(widths), max_rank, generator=g) / max_rank ** 0.5).to(dtype)
    scales = [float(s) for s in torch.rand(num_slots, generator=g) * 2]
    offsets = [0]
    for w in widths:
        offsets.append(offsets[-1] + w)
    return slots.tolist(), ranks, x, a, b, scales, offsets


table_from_stacked = LoRATable.from_stacked


def reference(x, a, b, ranks, scales, offsets, slots, y0):
    """The stacked reference (float32 accumulation, one rounding of y)."""
    batch = LoRABatch.build(slots)
    h = torch.zeros(x.shape[0], a.shape[1])
    sgmv_shrink_reference(x, a, ranks, batch, h, len(offsets) - 1)
    return sgmv_expand_reference(h, b, ranks, scales, batch, y0.clone(), offsets)
