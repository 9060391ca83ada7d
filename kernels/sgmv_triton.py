"""Triton SGMV kernels; `sgmv.py` holds their PyTorch reference and the dispatch, `lora_tiles.py` their tiling.

Grid: (segment, token block, slice x rank or output block [x K share]); where a batch holds more segments
than `segment_programs` (a decode graph's padding: the slots present first, then empty segments), the first
axis stops there and each program takes every that-many-th segment, so an empty segment costs a program four
scalar loads rather than a launch slot of its own. A program walks the tokens of its block of its segment
BLOCK_M at a time: a decode step's segments (one to a few tokens per adapter) are one program
each, so an adapter's A share and B tile are read once per step, not once per 16-token tile; a prefill's long
segment is cut into blocks of `tokens_per_program` tokens so it still fills the SMs. A segment whose block
lies past its end, or whose slot's rank lies below the program's rank block (the null slot's rank is 0), is
skipped: segments of different lengths and adapters of different ranks share one launch without padding work.
All slices of a fused projection (q/k/v, gate/up) are one launch.

Split-K without atomics: the shrink writes each K share's partial product to its own plane of an fp32
buffer [split_k, T, slices x R]; the expand sums the planes as it reads them. No zeroing pass, no atomic
order: the same sum whatever the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.dispatch import dot_in_fp32, ieee_fp32
from loraplex.kernels.lora_batch import LoRABatch
from loraplex.kernels.lora_tiles import BLOCK_M, LoRATiles


@triton.jit
def _segment_block(seg, starts_ptr, slots_ptr, ranks_ptr, tokens_per_program):
    """Segment `seg`: its slot (int64: slot x a slot's stride passes 2^31 with a thousand wide slots), the
    slot's rank and the [lo, hi) of this program's token block in the order."""
    slot = tl.load(slots_ptr + seg).to(tl.int64)
    rank = tl.load(ranks_ptr + slot)
    end = tl.load(starts_ptr + seg + 1)
    lo = tl.load(starts_ptr + seg) + tl.program_id(1) * tokens_per_program
    return slot, rank, lo, tl.minimum(end, lo + tokens_per_program)


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, part_ptr, ranks_ptr, order_ptr, starts_ptr, slots_ptr,
                   num_segments, in_features, max_rank, rank_blocks, split_k, k_share, tokens_per_program,
                   stride_xt, stride_xk, stride_as, stride_ar, stride_ak, stride_ps, stride_pt, stride_pr,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, FP32_DOT: tl.constexpr,
                   PRECISION: tl.constexpr):
    pid_r = tl.program_id(2) // split_k
    share = tl.program_id(2) % split_k
    k_lo = share * k_share
    k_hi = tl.minimum(k_lo + k_share, in_features)
    slice_id = pid_r // rank_blocks
    r0 = (pid_r % rank_blocks) * BLOCK_R
    for seg in range(tl.program_id(0), num_segments, tl.num_programs(0)):
        slot, rank, lo, hi = _segment_block(seg, starts_ptr, slots_ptr, ranks_ptr, tokens_per_program)
        if (lo < hi) & (r0 < rank):
            offs_r = r0 + tl.arange(0, BLOCK_R)
            mask_r = offs_r < rank
            rows = slice_id * max_rank + offs_r
            for m0 in range(lo, hi, BLOCK_M):
                offs_m = m0 + tl.arange(0, BLOCK_M)
                mask_m = offs_m < hi
                tokens = tl.load(order_ptr + offs_m, mask=mask_m, other=0)
                acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
                for k0 in range(k_lo, k_hi, BLOCK_K):
                    offs_k = k0 + tl.arange(0, BLOCK_K)
                    mask_k = offs_k < k_hi
                    x = tl.load(x_ptr + tokens[:, None] * stride_xt + offs_k[None, :] * stride_xk,
                                mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                    a = tl.load(a_ptr + slot * stride_as + rows[None, :] * stride_ar + offs_k[:, None] * stride_ak,
                                mask=mask_k[:, None] & mask_r[None, :], other=0.0)
                    if FP32_DOT:
                        x, a = x.to(tl.float32), a.to(tl.float32)
                    acc += tl.dot(x, a, input_precision=PRECISION)
                tl.store(part_ptr + share * stride_ps + tokens[:, None] * stride_pt + rows[None, :] * stride_pr, acc,
                         mask=mask_m[:, None] & mask_r[None, :])


@triton.jit
def _expand_kernel(part_ptr, b_ptr, y_ptr, ranks_ptr, scales_ptr, order_ptr, starts_ptr, slots_ptr, offsets_ptr,
                   weights_ptr, num_segments, max_rank, n_blocks, split_k, tokens_per_program,
                   stride_ps, stride_pt, stride_pr, stride_bs, stride_bn, stride_br, stride_yt, stride_yn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, FP32_DOT: tl.constexpr,
                   PRECISION: tl.constexpr, HAS_WEIGHTS: tl.constexpr):
    pid_n = tl.program_id(2)
    slice_id = pid_n // n_blocks
    n_lo = tl.load(offsets_ptr + slice_id)
    n_hi = tl.load(offsets_ptr + slice_id + 1)
    n0 = n_lo + (pid_n % n_blocks) * BLOCK_N
    for seg in range(tl.program_id(0), num_segments, tl.num_programs(0)):
        slot, rank, lo, hi = _segment_block(seg, starts_ptr, slots_ptr, ranks_ptr, tokens_per_program)
        if (lo < hi) & (n0 < n_hi) & (rank > 0):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < n_hi
            scale = tl.load(scales_ptr + slot)
            for m0 in range(lo, hi, BLOCK_M):
                offs_m = m0 + tl.arange(0, BLOCK_M)
                mask_m = offs_m < hi
                tokens = tl.load(order_ptr + offs_m, mask=mask_m, other=0)
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for r0 in range(0, rank, BLOCK_R):
                    offs_r = r0 + tl.arange(0, BLOCK_R)
                    mask_r = offs_r < rank
                    cols = slice_id * max_rank + offs_r
                    h_ptrs = part_ptr + tokens[:, None] * stride_pt + cols[None, :] * stride_pr
                    h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
                    for share in range(split_k):  # the shrink's K shares, summed in one order
                        h += tl.load(h_ptrs + share * stride_ps, mask=mask_m[:, None] & mask_r[None, :], other=0.0)
                    b = tl.load(b_ptr + slot * stride_bs + offs_n[None, :] * stride_bn + offs_r[:, None] * stride_br,
                                mask=mask_r[:, None] & mask_n[None, :], other=0.0)
                    h = h.to(b.dtype)
                    if FP32_DOT:
                        h, b = h.to(tl.float32), b.to(tl.float32)
                    acc += tl.dot(h, b, input_precision=PRECISION)
                if HAS_WEIGHTS:  # an adapter mix: each token's weight on its delta, beside its entry in the order
                    acc = acc * tl.load(weights_ptr + offs_m, mask=mask_m, other=0.0)[:, None]
                y_ptrs = y_ptr + tokens[:, None] * stride_yt + offs_n[None, :] * stride_yn
                mask = mask_m[:, None] & mask_n[None, :]
                y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
                tl.store(y_ptrs, (y + scale * acc).to(y_ptr.dtype.element_ty), mask=mask)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if ieee_fp32(dtype) else "tf32"


def _planes(h: torch.Tensor) -> torch.Tensor:
    """The shrink's output as [split_k, T, slices x R]: a two-dimensional one is a single plane."""
    return h if h.dim() == 3 else h.unsqueeze(0)


def sgmv_shrink_triton(x: torch.Tensor, lora_a: torch.Tensor, ranks: torch.Tensor, batch: LoRABatch,
                       out: torch.Tensor, tiles: LoRATiles) -> torch.Tensor:
    """`out` [tiles.split_k, T, slices x R] fp32 (two-dimensional when split_k is 1): each K share's partial
    product in its plane, only in the columns below each token's rank and the rows of tokens with an adapter
    (what the expand reads)."""
    if batch.num_segments == 0:
        return out
    part = _planes(out)
    assert part.shape[0] == tiles.split_k, "the shrink's buffer has one plane per K share"
    max_rank = lora_a.shape[1] // tiles.num_slices
    per, blocks = tiles.token_blocks(batch.max_seg_len)
    grid = (tiles.segment_columns(batch.num_segments), blocks, tiles.num_slices * tiles.rank_blocks * tiles.split_k)
    _shrink_kernel[grid](
        x, lora_a, part, ranks, batch.token_order, batch.seg_starts, batch.seg_slots, batch.num_segments,
        x.shape[1], max_rank, tiles.rank_blocks, tiles.split_k, tiles.k_share, per,
        x.stride(0), x.stride(1), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        part.stride(0), part.stride(1), part.stride(2),
        BLOCK_M=BLOCK_M, BLOCK_R=tiles.block_r, BLOCK_K=tiles.block_k, FP32_DOT=dot_in_fp32(x.dtype),
        PRECISION=_precision(x.dtype),
    )
    return out


def sgmv_expand_triton(h: torch.Tensor, lora_b: torch.Tensor, ranks: torch.Tensor, scales: torch.Tensor,
                       batch: LoRABatch, y: torch.Tensor, offsets: torch.Tensor, tiles: LoRATiles) -> torch.Tensor:
    """y += scale x (sum of h's planes) B per token; `offsets` the slice offsets on the device (persistent: no
    copy in the step)."""
    if batch.num_segments == 0:
        return y
    part = _planes(h)
    per, blocks = tiles.token_blocks(batch.max_seg_len)
    grid = (tiles.segment_columns(batch.num_segments), blocks, tiles.num_slices * tiles.n_blocks)
    _expand_kernel[grid](
        part, lora_b, y, ranks, scales, batch.token_order, batch.seg_starts, batch.seg_slots, offsets,
        scales if batch.order_weights is None else batch.order_weights, batch.num_segments, lora_b.shape[2],
        tiles.n_blocks,
        part.shape[0], per,
        part.stride(0), part.stride(1), part.stride(2), lora_b.stride(0), lora_b.stride(1), lora_b.stride(2),
        y.stride(0), y.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_N=tiles.block_n, BLOCK_R=tiles.expand_block_r,
        FP32_DOT=dot_in_fp32(lora_b.dtype), PRECISION=_precision(lora_b.dtype),
        HAS_WEIGHTS=batch.order_weights is not None,
    )
    return y
