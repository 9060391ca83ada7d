"""Triton kernels of the per-layer fused ops (`custom_ops.py`'s `forward_cuda`): residual add + RMSNorm, SiLU or
GeLU(tanh) times up, RoPE + KV write. Each is one launch in place of the PyTorch ops of `forward_native`.

Layout: all three are row-wise. RMSNorm: a program normalizes ROWS whole rows of the last dimension (a hidden
state, or a head of a [T, H, D] view for the q / k norms), float32 statistics. Activation * up: a program per
(row, BLOCK of the I outputs). RoPE + KV write: a program per (token, BLOCK_H heads of q, k and v together);
q and k heads are rotated (neox rotate-half), q written to a new [T, Hq, D], k and v to the caches at the
token's slot (slot -1: nothing written).

Numbers: each kernel rounds where the PyTorch ops round in the model's dtype (the normalized row before the
weight multiply, the activation before the multiply by up, each RoPE product before their sum), so bf16 / fp16
outputs equal `forward_native`'s or differ by a unit in the last place where float32 sums in another order
tip a rounding (in the interpreter; a GPU's approximate exp / rsqrt may tip one more, so two at most there).
A row's numbers depend on its row alone, and the launch shape on the widths alone, never on the number of
rows: the kernels are batch-invariant as `--deterministic` needs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ELEMENTS_PER_PROGRAM = 2048  # a program's tile in the norm and RoPE kernels: several short rows, or one long one
ACT_BLOCK = 1024  # outputs per program of the activation kernel


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, w_ptr, out_ptr, num_rows, width, stride_x, eps,
                     ROWS: tl.constexpr, BLOCK: tl.constexpr, RESIDUAL: tl.constexpr, ROUND: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = (rows[:, None] < num_rows) & (cols[None, :] < width)
    offsets = rows[:, None] * width + cols[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if RESIDUAL:  # the sum rounded to the model's dtype, as torch's add rounds it, before it is normalized
        x = (tl.load(residual_ptr + offsets, mask=mask, other=0.0).to(tl.float32) + x.to(tl.float32)).to(x.dtype)
        tl.store(residual_ptr + offsets, x, mask=mask)
    h = x.to(tl.float32)
    normed = h * tl.rsqrt(tl.sum(h * h, axis=1) / width + eps)[:, None]
    if ROUND:  # bf16 / fp16: the reference casts the normalized row to the model's dtype before the weight
        normed = normed.to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < width, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, (normed * w[None, :]).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, width, stride_x, GELU: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + width + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        inner = 0.7978845608028654 * (gate + 0.044715 * (gate * gate * gate))
        # tanh from exp(-2|u|) <= 1: no overflow, and no libdevice (the interpreter has none). Then torch's
        # 0.5 g (1 + tanh(u)) as written: where 1 + tanh(u) cancels (g < -3) it keeps the few bits torch keeps,
        # which g sigmoid(2u), the more exact form, would not
        e = tl.exp(-2.0 * tl.abs(inner))
        tanh = (1.0 - e) / (1.0 + e)
        act = 0.5 * gate * (1.0 + tl.where(inner < 0, -tanh, tanh))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    dtype = out_ptr.dtype.element_ty
    act = act.to(dtype).to(tl.float32)  # torch's activation returns the model's dtype, then multiplies
    tl.store(out_ptr + row * width + cols, (act * up).to(dtype), mask=mask)


@triton.jit
def _rope_kv_write_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
                          num_heads, num_kv_heads, head_dim, block_size, stride_t, stride_rope, stride_cb,
                          stride_cs, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # q heads, then k heads, then v heads
    d = tl.arange(0, BLOCK_D)
    half = head_dim // 2
    mask = (heads[:, None] < num_heads + 2 * num_kv_heads) & (d[None, :] < head_dim)
    row = qkv_ptr + t * stride_t + heads[:, None] * head_dim
    x = tl.load(row + d[None, :], mask=mask, other=0.0)
    # rotate-half: (-x[half:], x[:half]); the negation is exact, as in the reference
    partner = tl.where(d < half, d + half, d - half)
    rot = tl.load(row + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    rot = tl.where(d[None, :] < half, -rot, rot)
    cos = tl.load(cos_ptr + t * stride_rope + d, mask=d < head_dim, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_rope + d, mask=d < head_dim, other=0.0).to(tl.float32)
    dtype = qkv_ptr.dtype.element_ty
    # each product rounded to the model's dtype before the sum, as x * cos + rotate_half(x) * sin rounds
    rotated = ((x.to(tl.float32) * cos[None, :]).to(dtype).to(tl.float32) +
               (rot * sin[None, :]).to(dtype).to(tl.float32)).to(dtype)
    tl.store(q_ptr + t * num_heads * head_dim + heads[:, None] * head_dim + d[None, :], rotated,
             mask=mask & (heads[:, None] < num_heads))
    slot = tl.load(slots_ptr + t).to(tl.int64)  # int64: a slot times the block stride passes 2^31 in big caches
    if slot >= 0:
        cache_row = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs
        kv_head = heads[:, None] - num_heads
        cache_dtype = k_cache_ptr.dtype.element_ty  # a float16 cache under a bf16 model stores rounded copies
        tl.store(k_cache_ptr + cache_row + kv_head * head_dim + d[None, :], rotated.to(cache_dtype),
                 mask=mask & (kv_head >= 0) & (kv_head < num_kv_heads))
        tl.store(v_cache_ptr + cache_row + (kv_head - num_kv_heads) * head_dim + d[None, :], x.to(cache_dtype),
                 mask=mask & (kv_head >= num_kv_heads))


def norm_launch(width: int) -> dict:
    """The norm kernel's tile for a row width: whole rows, several per program where they are short (a head's
    q / k norm). From the width only, so a row's reduction is the same whatever the batch."""
    block = triton.next_power_of_2(width)
    rows = max(1, ELEMENTS_PER_PROGRAM // block)
    return dict(ROWS=rows, BLOCK=block, num_warps=min(max(rows * block // 256, 1), 16))


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dimension of x [..., D] (any leading dims: [T, D], or [T, H, D] for q / k norms);
    with `residual`: residual += x in place first, and the sum normalized."""
    width = x.shape[-1]
    rows = x.reshape(-1, width)
    assert rows.stride(1) == 1 and weight.shape == (width,)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if rows.shape[0] == 0:
        return out
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.is_contiguous()
    launch = norm_launch(width)
    grid = (triton.cdiv(rows.shape[0], launch["ROWS"]),)
    _rms_norm_kernel[grid](rows, rows if residual is None else residual, weight, out, rows.shape[0], width,
                           rows.stride(0), eps, RESIDUAL=residual is not None, ROUND=x.dtype != torch.float32,
                           **launch)
    return out


def act_and_mul_triton(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
    """[..., 2I] -> act(gate) * up [..., I]; act: SiLU, or GeLU with the tanh approximation (`gelu`)."""
    width = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * width)
    assert rows.stride(1) == 1
    out = torch.empty(*gate_up.shape[:-1], width, dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0] == 0:
        return out
    block = min(ACT_BLOCK, triton.next_power_of_2(width))
    _act_and_mul_kernel[(rows.shape[0], triton.cdiv(width, block))](rows, out, width, rows.stride(0), GELU=gelu,
                                                                   BLOCK=block, num_warps=4)
    return out


def rope_launch(num_heads: int, num_kv_heads: int, head_dim: int) -> dict:
    """Heads per program: a tile of about ELEMENTS_PER_PROGRAM, so a long head row does not spill registers."""
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_heads + 2 * num_kv_heads), max(1, ELEMENTS_PER_PROGRAM // block_d))
    return dict(BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4)


def rope_kv_write_triton(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                         num_kv_heads: int, slot_mapping: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor) -> torch.Tensor:
    """qkv [T, (Hq + 2 Hkv) D] and each token's cos / sin [T, 1, D] (or [T, D]) -> rotated q [T, Hq, D]; rotated k
    and v written into the caches [blocks, block_size, Hkv, D] at `slot_mapping` (-1: not written)."""
    num_tokens, head_dim = qkv.shape[0], k_cache.shape[-1]
    assert qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim and qkv.stride(1) == 1
    assert cos.stride(-1) == 1 and sin.stride() == cos.stride() and cos.shape[-1] == head_dim
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.stride() == v_cache.stride()
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q
    launch = rope_launch(num_heads, num_kv_heads, head_dim)
    grid = (num_tokens, triton.cdiv(num_heads + 2 * num_kv_heads, launch["BLOCK_H"]))
    _rope_kv_write_kernel[grid](qkv, cos, sin, q, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads, head_dim,
                                k_cache.shape[1], qkv.stride(0), cos.stride(0), k_cache.stride(0),
                                k_cache.stride(1), **launch)
    return q
