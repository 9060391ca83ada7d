"""GPU check for the Triton kernels, in one command (needs CUDA and triton):

    python benchmarks/gpu_kernels.py

1. Correctness on CUDA: SGMV shrink/expand and paged attention (decode and prefill chunks)
   against the PyTorch references, bf16 and fp16.
2. SGMV speed: achieved bandwidth against the bytes each call must move (x, the used slots'
   A/B, the output), for 1 / 8 / 64 adapters at T = 16 / 256 / 4096.
3. Paged attention speed against SDPA over the same K/V laid out contiguously.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from loraplex.kernels import dispatch
from loraplex.kernels.paged_attention import PagedAttentionMetadata, paged_attention
from loraplex.kernels.sgmv import LoRABatch, sgmv_expand, sgmv_shrink


def cuda_time(fn, repeats: int = 50) -> float:
    """Median seconds per call, CUDA events."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def with_backend(name, fn):
    with dispatch.forced_backend(name):
        return fn()


def sgmv_case(num_tokens, num_adapters, rank, hidden, widths, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(num_tokens, hidden, device="cuda", dtype=dtype, generator=g)
    a = torch.randn(num_adapters, len(widths) * rank, hidden, device="cuda", dtype=dtype, generator=g) / hidden ** 0.5
    b = torch.randn(num_adapters, sum(widths), rank, device="cuda", dtype=dtype, generator=g) / rank ** 0.5
    slots = [i % num_adapters for i in range(num_tokens)]
    offsets = [0]
    for w in widths:
        offsets.append(offsets[-1] + w)
    return x, a, b, [rank] * num_adapters, [1.5] * num_adapters, LoRABatch.build(slots, "cuda"), offsets


def check_sgmv(dtype) -> None:
    x, a, b, ranks, scales, batch, offsets = sgmv_case(300, 16, 32, 1024, [1024, 256, 256], dtype)
    n = len(offsets) - 1

    def run():
        h = torch.zeros(x.shape[0], a.shape[1], device="cuda")
        sgmv_shrink(x, a, ranks, batch, h, n)
        y = torch.zeros(x.shape[0], offsets[-1], device="cuda", dtype=dtype)
        sgmv_expand(h, b, ranks, scales, batch, y, offsets)
        return h, y

    (h_ref, y_ref), (h_tri, y_tri) = with_backend("torch", run), with_backend("triton", run)
    torch.testing.assert_close(h_tri, h_ref, atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(y_tri.float(), y_ref.float(), atol=5e-2, rtol=5e-2)
    print(f"sgmv {dtype}: triton == reference")


def bench_sgmv() -> list[dict]:
    hidden, rank, widths, dtype = 4096, 16, [4096, 1024, 1024], torch.bfloat16
    elt = 2
    print(f"\nSGMV bandwidth, hidden {hidden}, qkv {widths}, rank {rank}, bf16 (H200 HBM ~4.8 TB/s)")
    print(f"{'adapters':>8} {'T':>6} | {'shrink us':>9} {'GB/s':>7} | {'expand us':>9} {'GB/s':>7}")
    rows = []
    for num_adapters in (1, 8, 64):
        for num_tokens in (16, 256, 4096):
            x, a, b, ranks, scales, batch, offsets = sgmv_case(num_tokens, num_adapters, rank, hidden, widths, dtype)
            n, used = len(widths), min(num_adapters, num_tokens)
            h = torch.zeros(num_tokens, a.shape[1], device="cuda")
            y = torch.zeros(num_tokens, offsets[-1], device="cuda", dtype=dtype)
            ranks_t = torch.tensor(ranks, device="cuda", dtype=torch.int32)
            scales_t = torch.tensor(scales, device="cuda")
            t_s = cuda_time(lambda: sgmv_shrink(x, a, ranks_t, batch, h, n))
            t_e = cuda_time(lambda: sgmv_expand(h, b, ranks_t, scales_t, batch, y, offsets))
            shrink_bytes = num_tokens * hidden * elt + used * n * rank * hidden * elt + num_tokens * n * rank * 4
            expand_bytes = num_tokens * n * rank * 4 + used * sum(widths) * rank * elt + 2 * num_tokens * sum(widths) * elt
            print(f"{num_adapters:>8} {num_tokens:>6} | {t_s * 1e6:>9.1f} {shrink_bytes / t_s / 1e9:>7.0f} | "
                  f"{t_e * 1e6:>9.1f} {expand_bytes / t_e / 1e9:>7.0f}")
            rows.append({"adapters": num_adapters, "tokens": num_tokens, "shrink_gbs": shrink_bytes / t_s / 1e9,
                         "expand_gbs": expand_bytes / t_e / 1e9})
    return rows


def attention_case(batch, q_len, ctx, heads, kv_heads, dim, block_size, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    blocks_per = -(-(ctx + q_len) // block_size)
    num_blocks = batch * blocks_per
    kc = torch.randn(num_blocks, block_size, kv_heads, dim, device="cuda", dtype=dtype, generator=g)
    vc = torch.randn_like(kc)
    perm = torch.randperm(num_blocks, device="cuda", generator=g)
    tables = perm.view(batch, blocks_per)
    q = torch.randn(batch * q_len, heads, dim, device="cuda", dtype=dtype, generator=g)
    seq_lens = torch.full((batch,), ctx + q_len, device="cuda")
    starts = torch.arange(batch + 1, device="cuda") * q_len
    meta = PagedAttentionMetadata.build(torch.zeros(batch * q_len, dtype=torch.long, device="cuda"),
                                        tables, seq_lens, starts, block_size)
    return q, kc, vc, meta, tables


def check_attention(dtype) -> None:
    for q_len, ctx in ((1, 300), (37, 100)):
        q, kc, vc, meta, _ = attention_case(6, q_len, ctx, 32, 8, 128, 16, dtype)
        ref = with_backend("torch", lambda: paged_attention(q, kc, vc, meta, 128 ** -0.5))
        tri = with_backend("triton", lambda: paged_attention(q, kc, vc, meta, 128 ** -0.5))
        torch.testing.assert_close(tri.float(), ref.float(), atol=2e-2, rtol=2e-2)
    print(f"paged attention {dtype}: triton == reference (decode and prefill chunks)")


def bench_attention() -> None:
    print("\nPaged attention (Triton) vs SDPA on contiguous K/V, 32 heads / 8 KV heads, dim 128, bf16")
    print(f"{'batch':>5} {'q':>4} {'ctx':>6} | {'paged us':>9} {'sdpa us':>9} {'ratio':>6}")
    for batch, q_len, ctx in ((64, 1, 1024), (64, 1, 4096), (8, 512, 2048)):
        q, kc, vc, meta, tables = attention_case(batch, q_len, ctx, 32, 8, 128, 16, torch.bfloat16)
        t_paged = with_backend("triton", lambda: cuda_time(lambda: paged_attention(q, kc, vc, meta, 128 ** -0.5)))
        k = kc[tables].flatten(1, 2)[:, :ctx + q_len].transpose(1, 2).contiguous()
        v = vc[tables].flatten(1, 2)[:, :ctx + q_len].transpose(1, 2).contiguous()
        qq = q.view(batch, q_len, 32, 128).transpose(1, 2)
        mask = torch.arange(ctx + q_len, device="cuda")[None, :] <= (ctx + torch.arange(q_len, device="cuda"))[:, None]
        t_sdpa = cuda_time(lambda: F.scaled_dot_product_attention(qq, k, v, attn_mask=mask, enable_gqa=True))
        print(f"{batch:>5} {q_len:>4} {ctx:>6} | {t_paged * 1e6:>9.1f} {t_sdpa * 1e6:>9.1f} {t_paged / t_sdpa:>6.2f}")


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing measured")
        return 1
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for dtype in (torch.bfloat16, torch.float16):
        check_sgmv(dtype)
        check_attention(dtype)
    bench_sgmv()
    bench_attention()
    return 0


if __name__ == "__main__":
    sys.exit(main())
