"""SGMV shrink / expand for multi-LoRA batches (Punica / S-LoRA style).

For each token t with adapter slot s = slots[t] (-1: no adapter):
    shrink:  h[t, i*R:(i*R + rank[s])] = x[t] @ A[s, i*R:(i*R + rank[s])].T     (fp32)
    expand:  y[t, off[i]:off[i+1]]    += scale[s] * h[t, i*R:(i*R + rank[s])] @ B[s, off[i]:off[i+1], :rank[s]].T
where i runs over the slices of a fused projection (q/k/v, gate/up) and R is the max rank.

On CPU, decode-shaped batches take the C kernel in `cpu_kernels.py` instead (see the dispatch).
Tokens are grouped into segments of one slot through a sorted index list (`LoRABatch`), so the
batch itself is never reordered; each Triton program works on one segment, and a rank block
beyond the slot's own rank exits at once, so mixed ranks cost what their ranks cost.
Layouts: A [S, n_slices * R, in], B [S, sum(out_i), R], ranks [S] int32, scales [S] float.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.kernels import cpu_kernels
from loraplex.kernels.dispatch import use_cpu_kernel, use_triton


@dataclass
class LoRABatch:
    """Per-step grouping of tokens by adapter slot, shared by every LoRA layer."""

    token_order: torch.Tensor  # [N] indices of tokens with a slot, sorted by slot (stable)
    order_slots: torch.Tensor  # [N] the slot of each token in token_order
    seg_starts: torch.Tensor  # [G + 1] int32 offsets into token_order
    seg_slots: torch.Tensor  # [G] int32 slot of each segment
    max_seg_len: int
    host_starts: list[int]  # the same offsets and slots on the host, for the PyTorch path
    host_slots: list[int]

    @staticmethod
    def build(token_slots: list[int] | torch.Tensor, device: torch.device | str = "cpu") -> "LoRABatch":
        slots = torch.as_tensor(token_slots, dtype=torch.int64).cpu()
        keep = torch.nonzero(slots >= 0).flatten()
        sorted_slots, perm = torch.sort(slots[keep], stable=True)
        order = keep[perm]
        uniq, counts = torch.unique_consecutive(sorted_slots, return_counts=True)
        starts = [0] + torch.cumsum(counts, 0).tolist()
        return LoRABatch(
            token_order=order.to(device),
            order_slots=sorted_slots.to(device),
            seg_starts=torch.tensor(starts, dtype=torch.int32, device=device),
            seg_slots=uniq.to(torch.int32).to(device),
            max_seg_len=int(counts.max()) if len(counts) else 0,
            host_starts=starts,
            host_slots=uniq.tolist(),
        )

    @property
    def num_segments(self) -> int:
        return len(self.host_slots)

    def segments(self):
        """(slot, token indices) per segment, for the PyTorch path."""
        for g, slot in enumerate(self.host_slots):
            yield slot, self.token_order[self.host_starts[g]:self.host_starts[g + 1]]


# ---- PyTorch path (reference, and the CPU implementation) -------------------------------------

def sgmv_shrink_reference(x: torch.Tensor, lora_a: torch.Tensor, ranks: list[int] | torch.Tensor,
                          batch: LoRABatch, out: torch.Tensor, num_slices: int = 1) -> torch.Tensor:
    max_rank = lora_a.shape[1] // num_slices
    ranks = _host_list(ranks)
    out_slices = out.view(out.shape[0], num_slices, max_rank)
    for slot, idx in batch.segments():
        r = ranks[slot]
        if r == 0:
            continue
        a = lora_a[slot].view(num_slices, max_rank, -1)[:, :r].reshape(num_slices * r, -1)
        h = _f32(x.index_select(0, idx)) @ _f32(a).T
        out_slices[idx, :, :r] = h.view(-1, num_slices, r).to(out.dtype)
    return out


def sgmv_expand_reference(h: torch.Tensor, lora_b: torch.Tensor, ranks: list[int] | torch.Tensor,
                          scales: list[float] | torch.Tensor, batch: LoRABatch, y: torch.Tensor,
                          slice_offsets: list[int]) -> torch.Tensor:
    max_rank = lora_b.shape[2]
    ranks, scales = _host_list(ranks), _host_list(scales)
    for slot, idx in batch.segments():
        r = ranks[slot]
        if r == 0:
            continue
        h_seg = h.index_select(0, idx)
        delta = torch.empty(len(idx), y.shape[1], dtype=torch.float32, device=y.device)
        for i, (lo, hi) in enumerate(zip(slice_offsets[:-1], slice_offsets[1:])):
            torch.matmul(_f32(h_seg[:, i * max_rank:i * max_rank + r]), _f32(lora_b[slot, lo:hi, :r]).T,
                         out=delta[:, lo:hi])
        # one read-modify-write of the segment's rows, in fp32, as the kernel does
        y.index_copy_(0, idx, (_f32(y.index_select(0, idx)) + scales[slot] * delta).to(y.dtype))
    return y


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


def _host_list(values) -> list:
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)


# ---- CPU path -------------------------------------------------------------------------------
# benchmarks/lora_ops.py: a loop of per-segment GEMMs wins while segments are long; when the
# batch holds many adapters with a few tokens each, per-segment overhead dominates and one
# gathered bmm over all tokens wins (2-3x at 8-64 adapters, 16-64 tokens).
GATHER_BELOW_MEAN_SEGMENT = 8
# The C kernel (cpu_kernels.c) beats both while segments are short: 1.5-14x at 16 tokens over
# 1-16 adapters, even at 64 tokens of one adapter; per-segment GEMMs win on prefill chunks.
C_BELOW_MEAN_SEGMENT = 64


def sgmv_lora_cpu(x, lora_a, lora_b, ranks, scales, batch: LoRABatch, y, slice_offsets: list[int]):
    """Shrink and expand fused per segment, for a whole LoRA layer: no [T, n*R] intermediate,
    one `index_add_` per segment. Matmuls run in the model's dtype."""
    num_slices = len(slice_offsets) - 1
    if _gathered(batch):
        h = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
        sgmv_shrink_cpu(x, lora_a, ranks, batch, h, num_slices)
        return sgmv_expand_cpu(h, lora_b, ranks, scales, batch, y, slice_offsets)
    ranks, scales = _host_list(ranks), _host_list(scales)
    max_rank = lora_b.shape[2]
    for slot, idx in batch.segments():
        r = ranks[slot]
        if r == 0:
            continue
        a = lora_a[slot].view(num_slices, max_rank, -1)[:, :r].reshape(num_slices * r, -1)
        h = x.index_select(0, idx) @ a.T
        delta = torch.empty(len(idx), y.shape[1], dtype=y.dtype, device=y.device)
        for i, (lo, hi) in enumerate(zip(slice_offsets[:-1], slice_offsets[1:])):
            torch.matmul(h[:, i * r:(i + 1) * r], lora_b[slot, lo:hi, :r].T, out=delta[:, lo:hi])
        y.index_add_(0, idx, delta, alpha=scales[slot])
    return y


def _gathered(batch: LoRABatch) -> bool:
    return _mean_segment_below(batch, GATHER_BELOW_MEAN_SEGMENT)


def _mean_segment_below(batch: LoRABatch, tokens: int) -> bool:
    return len(batch.token_order) < tokens * batch.num_segments


def _rank_mask(ranks: list[int], slots: torch.Tensor, num_slices: int, max_rank: int) -> torch.Tensor:
    """[N, num_slices * max_rank]: True where a column lies within the token's slot rank."""
    cols = torch.arange(max_rank, device=slots.device).repeat(num_slices)
    return cols[None, :] < torch.tensor(ranks, device=slots.device)[slots][:, None]


def sgmv_shrink_cpu(x, lora_a, ranks, batch: LoRABatch, out, num_slices: int = 1):
    if not _gathered(batch):
        return sgmv_shrink_reference(x, lora_a, ranks, batch, out, num_slices)
    ranks = _host_list(ranks)
    slots = batch.order_slots
    idx = batch.token_order
    h = torch.bmm(_f32(lora_a[slots]), _f32(x.index_select(0, idx))[:, :, None])[:, :, 0]
    keep = _rank_mask(ranks, slots, num_slices, lora_a.shape[1] // num_slices)
    rows = out.index_select(0, idx)
    out.index_copy_(0, idx, torch.where(keep, h.to(out.dtype), rows))
    return out


def sgmv_expand_cpu(h, lora_b, ranks, scales, batch: LoRABatch, y, slice_offsets: list[int]):
    if not _gathered(batch):
        return sgmv_expand_reference(h, lora_b, ranks, scales, batch, y, slice_offsets)
    ranks, scales = _host_list(ranks), _host_list(scales)
    slots = batch.order_slots
    idx = batch.token_order
    max_rank = lora_b.shape[2]
    num_slices = len(slice_offsets) - 1
    h_tok = torch.where(_rank_mask(ranks, slots, num_slices, max_rank), _f32(h.index_select(0, idx)), 0.0)
    b_tok = _f32(lora_b[slots])  # [N, out, R]
    delta = torch.empty(len(idx), y.shape[1], dtype=torch.float32, device=y.device)
    for i, (lo, hi) in enumerate(zip(slice_offsets[:-1], slice_offsets[1:])):
        delta[:, lo:hi] = torch.bmm(b_tok[:, lo:hi], h_tok[:, i * max_rank:(i + 1) * max_rank, None])[:, :, 0]
    delta *= torch.tensor(scales, dtype=torch.float32, device=y.device)[slots][:, None]
    y.index_add_(0, idx, delta.to(y.dtype))
    return y


# ---- dispatch -----------------------------------------------------------------------------------

def sgmv_shrink(x, lora_a, ranks, batch: LoRABatch, out, num_slices: int = 1):
    if use_triton(x):
        from loraplex.kernels.sgmv_triton import sgmv_shrink_triton

        return sgmv_shrink_triton(x, lora_a, _as_tensor(ranks, torch.int32, x.device), batch, out, num_slices)
    return sgmv_shrink_cpu(x, lora_a, ranks, batch, out, num_slices)


def sgmv_expand(h, lora_b, ranks, scales, batch: LoRABatch, y, slice_offsets: list[int]):
    if use_triton(y):
        from loraplex.kernels.sgmv_triton import sgmv_expand_triton

        return sgmv_expand_triton(h, lora_b, _as_tensor(ranks, torch.int32, y.device),
                                  _as_tensor(scales, torch.float32, y.device), batch, y, slice_offsets)
    return sgmv_expand_cpu(h, lora_b, ranks, scales, batch, y, slice_offsets)


def sgmv_lora(x, lora_a, lora_b, ranks, scales, batch: LoRABatch, y, slice_offsets: list[int]):
    """y += scale[s] * (x A[s]^T) B[s]^T for each token's slot s: one LoRA layer."""
    if use_triton(y):
        h = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
        sgmv_shrink(x, lora_a, ranks, batch, h, len(slice_offsets) - 1)
        return sgmv_expand(h, lora_b, ranks, scales, batch, y, slice_offsets)
    if _mean_segment_below(batch, C_BELOW_MEAN_SEGMENT) and use_cpu_kernel(y) and x.dtype == torch.float32 \
            and cpu_kernels.usable(lora_a, lora_b, y):
        # decode-shaped batches: the C kernel reads each token's A and B in place
        return cpu_kernels.sgmv_lora_c(x.contiguous(), lora_a, lora_b, _host_list(ranks), _host_list(scales),
                                       batch.token_order, batch.order_slots, y, slice_offsets)
    return sgmv_lora_cpu(x, lora_a, lora_b, ranks, scales, batch, y, slice_offsets)


def _as_tensor(values, dtype, device) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values.to(device=device, dtype=dtype)
    return torch.tensor(values, dtype=dtype, device=device)
