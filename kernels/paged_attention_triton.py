"""Triton paged attention (the KV write is fused into RoPE: `layer_triton.py`); `paged_attention.py` holds the
PyTorch reference and the dispatch.

Layout (vLLM's unified attention): one program per (request, row block, KV head[, KV split]). The query
heads that share a KV head are packed into the rows with the request's query tokens (GQA packing: row r is
token r // group, query head kv_head * group + r % group), so each KV tile is read once for the whole group.
KV is walked in tiles of BLOCK_N positions gathered through the block table, independent of the block size
(blocks of 1..8 positions too: tl.dot needs >= 16), with an online softmax (FlashAttention style), masking
lower-right causally: query i of a chunk of length q sits at absolute position seq_len - q + i.
Split-KV (flash-decoding): where a decode batch has too few programs for the SMs (`plan`), each program
takes one contiguous share of its request's own context (so a graph captured for the longest context stays
right for any shorter one) and writes its partial softmax; `_reduce_kernel` merges the shares.
A sliding window (WINDOW, compiled in only when given) starts a program's walk at the first position its
first query sees, so blocks before the window are never read, and masks q - k >= window;
a soft cap (SOFTCAP) turns the scaled scores into cap * tanh(s / cap) before masking.
Block tables may be int32 or int64.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loraplex.kernels.dispatch import dot_in_fp32, ieee_fp32

DEFAULT_NUM_SMS = 132  # an H100 / H200: the split rule's target when the caller names no device
BLOCK_N = 32  # KV positions per tile, gathered across blocks of any size
DETERMINISTIC_BLOCK_M = 64  # --deterministic: every launch's rows per program
MIN_SPLIT_TOKENS = 256  # a split shorter than this costs more in the reduce than it saves


@functools.cache
def sm_count(device: torch.device) -> int:
    """The SMs a split (KV or K) fills: the CUDA device's own count, else the default target."""
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def _kv_range(seq_len, q_len, first_tok, last_tok, split, num_splits, window,
              BLOCK_N: tl.constexpr, WINDOW: tl.constexpr, SPLIT: tl.constexpr):
    """[lo, hi): the KV tiles this program walks, and `first`: the first position it reads. The rows' span runs
    from the first position the first token sees (its window start) to the last token's own position; a split
    takes its share of it, whole tiles each, from the request's own lengths."""
    hi = seq_len - q_len + last_tok + 1
    first = 0
    if WINDOW:
        first = tl.maximum(seq_len - q_len + first_tok - window + 1, 0)
    # from a whole tile: a query's tiles start at the same positions whichever rows share its program; the
    # positions before `first` are masked, not read (their blocks may be freed)
    lo = first // BLOCK_N * BLOCK_N
    if SPLIT:
        share = tl.cdiv(tl.cdiv(hi - lo, num_splits), BLOCK_N) * BLOCK_N
        lo = lo + split * share
        hi = tl.minimum(hi, lo + share)
    return lo, hi, first


@triton.jit
def _paged_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_ptr, m_ptr, l_ptr,
                            tables_ptr, seq_lens_ptr, starts_ptr,
                            scale, group, head_dim, block_size, window, softcap, num_splits,
                            stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_ot, stride_oh,
                            stride_tb, num_heads,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                            FP32_DOT: tl.constexpr, PRECISION: tl.constexpr, WINDOW: tl.constexpr,
                            SOFTCAP: tl.constexpr, SPLIT: tl.constexpr):
    req = tl.program_id(0)
    pid_m = tl.program_id(1)
    kv_head = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits
    q_start = tl.load(starts_ptr + req)
    q_len = tl.load(starts_ptr + req + 1) - q_start
    if pid_m * BLOCK_M < q_len * group:
        seq_len = tl.load(seq_lens_ptr + req)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        tok = rows // group
        head = kv_head * group + rows % group
        mask_m = tok < q_len
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < head_dim
        q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=mask_m[:, None] & mask_d[None, :], other=0.0)
        q_pos = seq_len - q_len + tok  # absolute positions: lower-right causal
        last_tok = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // group, q_len - 1)
        lo, hi, first = _kv_range(seq_len, q_len, (pid_m * BLOCK_M) // group, last_tok, split, num_splits,
                                  window, BLOCK_N, WINDOW, SPLIT)
        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        table = tables_ptr + req.to(tl.int64) * stride_tb
        for n0 in range(lo, hi, BLOCK_N):
            kv_pos = n0 + tl.arange(0, BLOCK_N)
            kv_ok = (kv_pos >= first) & (kv_pos < hi)
            block = tl.load(table + kv_pos // block_size, mask=kv_ok, other=0).to(tl.int64)  # int32 or int64 tables
            base = block * stride_cb + (kv_pos % block_size) * stride_cs + kv_head * stride_ch  # [N]
            k = tl.load(k_cache_ptr + base[None, :] + offs_d[:, None], mask=kv_ok[None, :] & mask_d[:, None],
                        other=0.0)  # [D, N]
            v = tl.load(v_cache_ptr + base[:, None] + offs_d[None, :], mask=kv_ok[:, None] & mask_d[None, :],
                        other=0.0)  # [N, D]
            k, v = k.to(q.dtype), v.to(q.dtype)  # a float16 KV cache under a bfloat16 / float32 model
            qq = q
            if FP32_DOT:
                qq, k, v = q.to(tl.float32), k.to(tl.float32), v.to(tl.float32)
            s = tl.dot(qq, k, input_precision=PRECISION) * scale
            if SOFTCAP:  # tanh(x) = 1 - 2 / (e^(2x) + 1): e^(2x) overflowing to inf still gives 1
                s = softcap * (1.0 - 2.0 / (tl.exp(s * (2.0 / softcap)) + 1.0))
            visible = (kv_pos[None, :] <= q_pos[:, None]) & kv_ok[None, :]
            if WINDOW:
                visible = visible & (q_pos[:, None] - kv_pos[None, :] < window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # a row that has seen only -inf so far (its window starts later, or a padding row): sums stay 0
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        flat = (q_start + tok) * num_heads + head  # [M] (token, head) index
        if SPLIT:  # the partial softmax of this share: the reduce merges them
            tl.store(m_ptr + flat * num_splits + split, m_i, mask=mask_m)
            tl.store(l_ptr + flat * num_splits + split, l_i, mask=mask_m)
            tl.store(part_ptr + (flat * num_splits + split)[:, None] * BLOCK_D + offs_d[None, :], acc,
                     mask=mask_m[:, None])
        else:
            acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # rows past the chunk's end: no 0 / 0
            tl.store(out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


@triton.jit
def _reduce_kernel(part_ptr, m_ptr, l_ptr, out_ptr, num_heads, num_splits, head_dim, stride_ot, stride_oh,
                   BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """One (token, head): the shares' partial softmaxes rescaled to their common maximum and summed."""
    flat = tl.program_id(0)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    l_s = tl.load(l_ptr + flat * num_splits + offs_s, mask=mask_s, other=0.0)
    m_s = tl.load(m_ptr + flat * num_splits + offs_s, mask=mask_s, other=float("-inf"))
    m_s = tl.where(l_s > 0, m_s, float("-inf"))  # a share that saw nothing weighs nothing
    weight = tl.exp(m_s - tl.max(m_s, 0))
    part = tl.load(part_ptr + (flat * num_splits + offs_s)[:, None] * BLOCK_D + offs_d[None, :],
                   mask=mask_s[:, None], other=0.0)
    acc = tl.sum(part * weight[:, None], 0) / tl.sum(l_s * weight, 0)
    token, head = flat // num_heads, flat % num_heads
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, acc.to(out_ptr.dtype.element_ty),
             mask=offs_d < head_dim)


@dataclass(frozen=True)
class LaunchPlan:
    """The attention launch decided from shapes: rows per program, KV splits, and the grid
    (request, row block, KV head x split)."""

    block_m: int
    num_splits: int
    grid: tuple[int, int, int]

    @property
    def programs(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]


def plan(num_requests: int, num_heads: int, num_kv_heads: int, max_query_len: int, max_seq_len: int | None,
         sliding_window: int | None = None, num_sms: int = DEFAULT_NUM_SMS, deterministic: bool = False) -> LaunchPlan:
    """GQA-packed rows (a KV head's query heads x query tokens); KV split only for decode batches whose
    programs would leave SMs idle, into shares of at least MIN_SPLIT_TOKENS of the span a query reads (its
    context, or its window). `deterministic`: one row block size and no split, whatever the step's shapes, so a
    query's sums run in one order (its tiles start at whole BLOCK_N positions)."""
    group = num_heads // num_kv_heads
    block_m = DETERMINISTIC_BLOCK_M if deterministic else max(16, min(64, triton.next_power_of_2(max_query_len * group)))
    programs = num_requests * num_kv_heads * triton.cdiv(max_query_len * group, block_m)
    splits = 1
    if not deterministic and max_query_len == 1 and max_seq_len is not None and programs < num_sms:
        span = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window)
        splits = max(1, min(triton.cdiv(num_sms, programs), span // MIN_SPLIT_TOKENS))
    grid = (num_requests, triton.cdiv(max_query_len * group, block_m), num_kv_heads * splits)
    return LaunchPlan(block_m, splits, grid)


def attention_constants(dtype: torch.dtype, head_dim: int, launch: LaunchPlan, sliding_window: int | None,
                        softcap: float | None) -> dict:
    """The attention kernel's compile-time constants: none depends on the block size, so every block size
    shares one compiled kernel whose dots are BLOCK_M x BLOCK_D x BLOCK_N (all >= 16, as tl.dot needs)."""
    return dict(BLOCK_M=launch.block_m, BLOCK_N=BLOCK_N, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
                FP32_DOT=dot_in_fp32(dtype), PRECISION="ieee" if ieee_fp32(dtype) else "tf32",
                WINDOW=sliding_window is not None, SOFTCAP=softcap is not None, SPLIT=launch.num_splits > 1)


def paged_attention_triton(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                           max_query_len: int, scale: float, sliding_window: int | None = None,
                           softcap: float | None = None, max_seq_len: int | None = None,
                           num_sms: int = DEFAULT_NUM_SMS, deterministic: bool = False) -> torch.Tensor:
    """`max_seq_len` (a host bound on every context, None: unknown, no split) and `num_sms` decide the
    KV split (`plan`); `deterministic`: none, and one row block size."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    assert query.stride(2) == 1 and k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    assert block_tables.dtype in (torch.int32, torch.int64) and block_tables.stride(1) == 1
    launch = plan(len(seq_lens), num_heads, num_kv_heads, max_query_len, max_seq_len, sliding_window, num_sms,
                  deterministic)
    block_d = max(16, triton.next_power_of_2(head_dim))
    out = torch.empty_like(query)
    split = launch.num_splits > 1
    stats = (num_tokens, num_heads, launch.num_splits) if split else (1,)
    m = torch.empty(stats, dtype=torch.float32, device=query.device)
    l = torch.empty_like(m)
    part = torch.empty(*stats, block_d if split else 1, dtype=torch.float32, device=query.device)
    _paged_attention_kernel[launch.grid](
        query, k_cache, v_cache, out, part, m, l, block_tables, seq_lens, query_start_loc,
        scale, num_heads // num_kv_heads, head_dim, k_cache.shape[1], sliding_window or 0, softcap or 0.0,
        launch.num_splits,
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), block_tables.stride(0), num_heads,
        **attention_constants(query.dtype, head_dim, launch, sliding_window, softcap),
    )
    if split:
        _reduce_kernel[(num_tokens * num_heads,)](
            part, m, l, out, num_heads, launch.num_splits, head_dim, out.stride(0), out.stride(1),
            BLOCK_S=triton.next_power_of_2(launch.num_splits), BLOCK_D=block_d,
        )
    return out
