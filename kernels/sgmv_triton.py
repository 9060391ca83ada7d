"""Triton SGMV kernels; `sgmv.py` holds their PyTorch reference and the dispatch.

Grid: (segment, token block, slice x output block). A program whose token block lies past its
segment's end, or whose rank block lies past its slot's rank, returns at once: segments of
different lengths and adapters of different ranks share one launch without padding work.
Split-K (`shrink_plan`): where a shrink has too few programs for the SMs (batch 1: one to three), the
third grid axis also splits `in_features` into shares whose partial sums are atomically added into the
fp32 output, zeroed first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loraplex.kernels.dispatch import dot_in_fp32, ieee_fp32
from loraplex.kernels.paged_attention_triton import DEFAULT_NUM_SMS
from loraplex.kernels.lora_batch import LoRABatch

BLOCK_M = 16  # tokens per program (tl.dot needs >= 16)
MIN_SPLIT_K = 256  # input features per split-K share: below it the atomics cost more than the idle SMs


@triton.jit
def _segment_tokens(order_ptr, starts_ptr, slots_ptr, ranks_ptr, BLOCK_M: tl.constexpr):
    """This program's segment: its slot, the slot's rank, its block of token indices and their mask.
    An empty block (past the segment's end) has an all-false mask."""
    seg = tl.program_id(0)
    slot = tl.load(slots_ptr + seg)
    rank = tl.load(ranks_ptr + slot)
    end = tl.load(starts_ptr + seg + 1)
    offs_m = tl.load(starts_ptr + seg) + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < end
    tokens = tl.load(order_ptr + offs_m, mask=mask_m, other=0)
    return slot, rank, tokens, mask_m


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, out_ptr, ranks_ptr, order_ptr, starts_ptr, slots_ptr,
                   in_features, max_rank, rank_blocks, split_k, k_share,
                   stride_xt, stride_xk, stride_as, stride_ar, stride_ak, stride_ot, stride_or,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, FP32_DOT: tl.constexpr,
                   PRECISION: tl.constexpr, SPLIT_K: tl.constexpr):
    pid_r = tl.program_id(2) // split_k
    k_lo = (tl.program_id(2) % split_k) * k_share
    k_hi = tl.minimum(k_lo + k_share, in_features)
    slice_id = pid_r // rank_blocks
    r0 = (pid_r % rank_blocks) * BLOCK_R
    slot, rank, tokens, mask_m = _segment_tokens(order_ptr, starts_ptr, slots_ptr, ranks_ptr, BLOCK_M)
    if (tl.max(mask_m.to(tl.int32), 0) > 0) & (r0 < rank):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = offs_r < rank
        rows = slice_id * max_rank + offs_r
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
        out_ptrs = out_ptr + tokens[:, None] * stride_ot + rows[None, :] * stride_or
        if SPLIT_K:  # this share's partial sum into the zeroed fp32 output
            tl.atomic_add(out_ptrs, acc, mask=mask_m[:, None] & mask_r[None, :])
        else:
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_r[None, :])


@triton.jit
def _expand_kernel(h_ptr, b_ptr, y_ptr, ranks_ptr, scales_ptr, order_ptr, starts_ptr, slots_ptr, offsets_ptr,
                   weights_ptr, max_rank, n_blocks,
                   stride_ht, stride_hr, stride_bs, stride_bn, stride_br, stride_yt, stride_yn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, FP32_DOT: tl.constexpr,
                   PRECISION: tl.constexpr, HAS_WEIGHTS: tl.constexpr):
    pid_n = tl.program_id(2)
    slice_id = pid_n // n_blocks
    lo = tl.load(offsets_ptr + slice_id)
    hi = tl.load(offsets_ptr + slice_id + 1)
    n0 = lo + (pid_n % n_blocks) * BLOCK_N
    slot, rank, tokens, mask_m = _segment_tokens(order_ptr, starts_ptr, slots_ptr, ranks_ptr, BLOCK_M)
    if (tl.max(mask_m.to(tl.int32), 0) > 0) & (n0 < hi) & (rank > 0):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in range(0, rank, BLOCK_R):
            offs_r = r0 + tl.arange(0, BLOCK_R)
            mask_r = offs_r < rank
            h = tl.load(h_ptr + tokens[:, None] * stride_ht + (slice_id * max_rank + offs_r)[None, :] * stride_hr,
                        mask=mask_m[:, None] & mask_r[None, :], other=0.0)
            b = tl.load(b_ptr + slot * stride_bs + offs_n[None, :] * stride_bn + offs_r[:, None] * stride_br,
                        mask=mask_r[:, None] & mask_n[None, :], other=0.0)
            h = h.to(b.dtype)
            if FP32_DOT:
                h, b = h.to(tl.float32), b.to(tl.float32)
            acc += tl.dot(h, b, input_precision=PRECISION)
        scale = tl.load(scales_ptr + slot)
        if HAS_WEIGHTS:  # an adapter mix: each token's weight on its delta, beside its entry in the order
            offs_m = tl.load(starts_ptr + tl.program_id(0)) + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
            acc = acc * tl.load(weights_ptr + offs_m, mask=mask_m, other=0.0)[:, None]
        y_ptrs = y_ptr + tokens[:, None] * stride_yt + offs_n[None, :] * stride_yn
        mask = mask_m[:, None] & mask_n[None, :]
        y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptrs, (y + scale * acc).to(y_ptr.dtype.element_ty), mask=mask)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if ieee_fp32(dtype) else "tf32"


def _block(n: int, lo: int = 16, hi: int = 64) -> int:
    return max(lo, min(hi, triton.next_power_of_2(n)))


@dataclass(frozen=True)
class ShrinkPlan:
    """The shrink launch decided from shapes: K shares (1: no split-K), input features per share, grid
    (segment, token block, slice x rank block x share)."""

    split_k: int
    k_share: int
    grid: tuple[int, int, int]


def shrink_plan(num_segments: int, max_seg_len: int, num_slices: int, max_rank: int, in_features: int,
                out_dtype: torch.dtype, num_sms: int = DEFAULT_NUM_SMS) -> ShrinkPlan:
    """Split-K where the programs would leave SMs idle (small batches) and the output takes fp32 atomics,
    into shares of at least MIN_SPLIT_K features, whole K tiles each."""
    rank_blocks = triton.cdiv(max_rank, _block(max_rank))
    programs = num_segments * triton.cdiv(max_seg_len, BLOCK_M) * num_slices * rank_blocks
    split_k = 1
    if out_dtype == torch.float32 and programs < num_sms:
        split_k = max(1, min(triton.cdiv(num_sms, programs), in_features // MIN_SPLIT_K))
    block_k = _block(in_features, 16, 128)
    k_share = triton.cdiv(triton.cdiv(in_features, split_k), block_k) * block_k
    split_k = triton.cdiv(in_features, k_share)  # no share left empty by the rounding
    grid = (num_segments, triton.cdiv(max_seg_len, BLOCK_M), num_slices * rank_blocks * split_k)
    return ShrinkPlan(split_k, k_share, grid)


def sgmv_shrink_triton(x: torch.Tensor, lora_a: torch.Tensor, ranks: torch.Tensor, batch: LoRABatch,
                       out: torch.Tensor, num_slices: int = 1, num_sms: int = DEFAULT_NUM_SMS) -> torch.Tensor:
    """Under split-K `out` is zeroed first (the shares add into it): its columns past a slot's rank and the
    rows of tokens without an adapter then hold 0, which is what no reader looks at."""
    if batch.num_segments == 0:
        return out
    max_rank = lora_a.shape[1] // num_slices
    block_r = _block(max_rank)
    launch = shrink_plan(batch.num_segments, batch.max_seg_len, num_slices, max_rank, x.shape[1], out.dtype,
                         num_sms)
    if launch.split_k > 1:
        out.zero_()
    _shrink_kernel[launch.grid](
        x, lora_a, out, ranks, batch.token_order, batch.seg_starts, batch.seg_slots,
        x.shape[1], max_rank, triton.cdiv(max_rank, block_r), launch.split_k, launch.k_share,
        x.stride(0), x.stride(1), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        out.stride(0), out.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=_block(x.shape[1], 16, 128), FP32_DOT=dot_in_fp32(x.dtype),
        PRECISION=_precision(x.dtype), SPLIT_K=launch.split_k > 1,
    )
    return out


def sgmv_expand_triton(h: torch.Tensor, lora_b: torch.Tensor, ranks: torch.Tensor, scales: torch.Tensor,
                       batch: LoRABatch, y: torch.Tensor, slice_offsets: list[int],
                       offsets: torch.Tensor | None = None) -> torch.Tensor:
    """`offsets`: `slice_offsets` already on the device (persistent: no copy in the step)."""
    if batch.num_segments == 0:
        return y
    widths = [b - a for a, b in zip(slice_offsets[:-1], slice_offsets[1:])]
    block_n = _block(max(widths), 16, 128)
    n_blocks = triton.cdiv(max(widths), block_n)
    if offsets is None:
        offsets = torch.tensor(slice_offsets, dtype=torch.int32, device=y.device)
    grid = (batch.num_segments, triton.cdiv(batch.max_seg_len, BLOCK_M), len(widths) * n_blocks)
    _expand_kernel[grid](
        h, lora_b, y, ranks, scales, batch.token_order, batch.seg_starts, batch.seg_slots, offsets,
        scales if batch.order_weights is None else batch.order_weights, lora_b.shape[2], n_blocks,
        h.stride(0), h.stride(1), lora_b.stride(0), lora_b.stride(1), lora_b.stride(2),
        y.stride(0), y.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_R=_block(lora_b.shape[2], 16, 64),
        FP32_DOT=dot_in_fp32(lora_b.dtype), PRECISION=_precision(lora_b.dtype),
        HAS_WEIGHTS=batch.order_weights is not None,
    )
    return y
