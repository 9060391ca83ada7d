"""The batch-invariant matmul of --deterministic on CUDA: y = x w^T for x [M, K] and a plain weight w [N, K].

cuBLAS picks its algorithm, tiles and split-K from M, so a token's sums change with the batch. Here every launch
has one tiling (BLOCK_M x BLOCK_N output tiles, K walked from 0 in BLOCK_K steps by one `tl.dot` shape, float32
accumulators, no split-K, no autotuning): a row's outputs come from the same instructions in the same order
whatever M is and whichever rows share its tile. The numbers are those of a bf16 / fp16 GEMM with float32 sums;
the speed is a plain Triton GEMM's (docs/engine.md, "Deterministic inference").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.dispatch import dot_in_fp32, ieee_fp32

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32


@triton.jit
def _invariant_matmul_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             FP32_DOT: tl.constexpr, PRECISION: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        a = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
                    mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)  # [M, K]
        b = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None],
                    mask=(cols[None, :] < N) & (ks[:, None] < K), other=0.0)  # [K, N]
        if FP32_DOT:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def invariant_matmul_triton(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] times weight [N, K] (x's dtype) -> [..., N], each row's sums in one fixed order."""
    n, k = weight.shape
    flat = x.reshape(-1, k)
    if flat.stride(1) != 1:
        flat = flat.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    out = torch.empty(flat.shape[0], n, dtype=x.dtype, device=x.device)
    if flat.shape[0] and n:
        grid = (triton.cdiv(flat.shape[0], BLOCK_M), triton.cdiv(n, BLOCK_N))
        _invariant_matmul_kernel[grid](flat, weight, out, flat.shape[0], n, k, flat.stride(0), weight.stride(0),
                                       out.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                                       FP32_DOT=dot_in_fp32(x.dtype),
                                       PRECISION="ieee" if ieee_fp32(x.dtype) else "tf32")
    return out.view(*x.shape[:-1], n)
