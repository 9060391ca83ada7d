"""Triton paged attention and KV write; `paged_attention.py` holds the PyTorch reference and
the dispatch.

Attention grid: (request, query block, query head). A program walks its request's block table
one KV block at a time with an online softmax (FlashAttention style), masking lower-right
causally: query i of a chunk of length q sits at absolute position seq_len - q + i. Decode is
the same kernel with one query per request. GQA maps query head h to KV head h // group.
A sliding window (WINDOW, compiled in only when given) starts a program's walk at the block holding the
first position its first query sees, so blocks before the window are never read, and masks q - k >= window;
a soft cap (SOFTCAP) turns the scaled scores into cap * tanh(s / cap) before masking.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.dispatch import dot_in_fp32, ieee_fp32


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, row_size, block_size,
                     stride_kt, stride_vt, stride_cb, stride_cs, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    if slot >= 0:
        offs = tl.arange(0, BLOCK)
        mask = offs < row_size
        dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs + offs
        dtype = k_cache_ptr.dtype.element_ty  # a float16 cache stores rounded copies
        tl.store(k_cache_ptr + dst, tl.load(k_ptr + t * stride_kt + offs, mask=mask).to(dtype), mask=mask)
        tl.store(v_cache_ptr + dst, tl.load(v_ptr + t * stride_vt + offs, mask=mask).to(dtype), mask=mask)


@triton.jit
def _paged_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, tables_ptr, seq_lens_ptr, starts_ptr,
                            scale, group, head_dim, window, softcap,
                            stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_ot, stride_oh,
                            stride_tb,
                            BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                            FP32_DOT: tl.constexpr, PRECISION: tl.constexpr, WINDOW: tl.constexpr,
                            SOFTCAP: tl.constexpr):
    req = tl.program_id(0)
    pid_m = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(starts_ptr + req)
    q_len = tl.load(starts_ptr + req + 1) - q_start
    if pid_m * BLOCK_M < q_len:
        seq_len = tl.load(seq_lens_ptr + req)
        kv_head = head // group
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < q_len
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < head_dim
        q = tl.load(q_ptr + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                    mask=mask_m[:, None] & mask_d[None, :], other=0.0)
        q_pos = seq_len - q_len + offs_m  # absolute positions: lower-right causal
        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        kv_end = tl.minimum(seq_len, seq_len - q_len + (pid_m + 1) * BLOCK_M)
        offs_s = tl.arange(0, BLOCK_SIZE)
        j_start = 0
        if WINDOW:  # the block of the first position this tile's first query sees
            j_start = tl.maximum(seq_len - q_len + pid_m * BLOCK_M - window + 1, 0) // BLOCK_SIZE
        for j in range(j_start, tl.cdiv(kv_end, BLOCK_SIZE)):
            block = tl.load(tables_ptr + req * stride_tb + j)
            base = block * stride_cb + kv_head * stride_ch
            k = tl.load(k_cache_ptr + base + offs_s[None, :] * stride_cs + offs_d[:, None],
                        mask=mask_d[:, None], other=0.0)  # [D, S]
            v = tl.load(v_cache_ptr + base + offs_s[:, None] * stride_cs + offs_d[None, :],
                        mask=mask_d[None, :], other=0.0)  # [S, D]
            k, v = k.to(q.dtype), v.to(q.dtype)  # a float16 KV cache under a bfloat16 / float32 model
            qq = q
            if FP32_DOT:
                qq, k, v = q.to(tl.float32), k.to(tl.float32), v.to(tl.float32)
            s = tl.dot(qq, k, input_precision=PRECISION) * scale
            if SOFTCAP:  # tanh(x) = 1 - 2 / (e^(2x) + 1): e^(2x) overflowing to inf still gives 1
                s = softcap * (1.0 - 2.0 / (tl.exp(s * (2.0 / softcap)) + 1.0))
            kv_pos = j * BLOCK_SIZE + offs_s
            visible = (kv_pos[None, :] <= q_pos[:, None]) & (kv_pos[None, :] < seq_len)
            if WINDOW:
                visible = visible & (q_pos[:, None] - kv_pos[None, :] < window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            if WINDOW:  # a row whose window starts past this block has seen only -inf: keep its sums at 0
                m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        if WINDOW:  # rows past the chunk's end may have seen nothing: no 0 / 0 (they are not stored)
            l_i = tl.where(l_i > 0, l_i, 1.0)
        acc = acc / l_i[:, None]
        tl.store(out_ptr + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def write_kv_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    num_tokens, num_heads, head_dim = key.shape
    assert key.stride(2) == 1 and key.stride(1) == head_dim and value.stride(1) == head_dim
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.stride() == v_cache.stride()
    row = num_heads * head_dim
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, row, k_cache.shape[1],
        key.stride(0), value.stride(0), k_cache.stride(0), k_cache.stride(1),
        BLOCK=triton.next_power_of_2(row),
    )


def paged_attention_triton(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                           max_query_len: int, scale: float, sliding_window: int | None = None,
                           softcap: float | None = None) -> torch.Tensor:
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    assert query.stride(2) == 1 and k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    out = torch.empty_like(query)
    block_m = 16
    grid = (len(seq_lens), triton.cdiv(max_query_len, block_m), num_heads)
    _paged_attention_kernel[grid](
        query, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc,
        scale, num_heads // num_kv_heads, head_dim, sliding_window or 0, softcap or 0.0,
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), block_tables.stride(0),
        BLOCK_M=block_m, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=k_cache.shape[1],
        FP32_DOT=dot_in_fp32(query.dtype), PRECISION="ieee" if ieee_fp32(query.dtype) else "tf32",
        WINDOW=sliding_window is not None, SOFTCAP=softcap is not None,
    )
    return out
