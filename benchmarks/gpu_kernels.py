"""GPU check for the Triton kernels, in one command (needs CUDA and triton):

    python benchmarks/gpu_kernels.py [--tune-lora]

1. Correctness on CUDA: SGMV shrink/expand and paged attention (decode and prefill chunks)
   against the PyTorch references, bf16 and fp16.
2. SGMV speed: achieved bandwidth against the bytes each call must move (x, the used slots'
   A/B, the output), for 1 / 8 / 64 adapters at T = 16 / 256 / 4096; the fused decode delta (shrink + expand
   as the engine runs them) on each Llama-8B projection, 64 and 8 adapters; with --tune-lora, the block sizes
   (`kernels/lora_tiles.LoRATune`) timed one field at a time and the best printed as this card's entry.
3. Paged attention speed against SDPA over the same K/V laid out contiguously (decode: no mask; a fresh
   prompt: `is_causal`, SDPA's flash backend; a chunk after cached context: SDPA's lower-right causal bias).
4. Prefill attention for fresh prompts: the paged Triton kernel vs the engine's SDPA path
   (`PagedAttention(prefill="sdpa")`, what `--prefill-attention` chooses between).

Timing (`cuda_time`): inputs are built before the timer; each call sits between its own pair of CUDA events,
calls queued back to back (one sync at the end, so the host's launch cost hides behind the device's work), an
L2 flush (a write of a buffer larger than L2) before each call, outside its events; the median is reported.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from loraplex.kernels.custom_ops import PagedAttention
from loraplex.kernels.dispatch import Backend, KernelConfig
from loraplex.kernels.paged_attention import PagedAttentionMetadata, attention_kernel
from loraplex.kernels.lora_batch import LoRABatch
from loraplex.kernels.sgmv import sgmv_expand, sgmv_shrink

L2_FLUSH_BYTES = 256 << 20  # several times any current L2 (H100 / H200: 50 MiB)
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3.1-8B's attention


def flush_buffer(device: str | torch.device = "cuda") -> torch.Tensor:
    """Zeroing this evicts what the previous call left in L2."""
    return torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device)


def cuda_time(fn, iters: int = 100, warmup: int = 5, flush: torch.Tensor | None = None) -> float:
    """Median device seconds of one `fn()` call over `iters` calls: only the call between its events (the
    flush before it is outside), no host sync between calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, end in zip(starts, ends):
        if flush is not None:
            flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = sorted(start.elapsed_time(end) / 1e3 for start, end in zip(starts, ends))
    return times[len(times) // 2]


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

    def run(backend: Backend):
        config = KernelConfig(backend=backend, device_type="cuda", dtype=dtype)
        h = torch.zeros(x.shape[0], a.shape[1], device="cuda")
        sgmv_shrink(config, x, a, ranks, batch, h, n)
        y = torch.zeros(x.shape[0], offsets[-1], device="cuda", dtype=dtype)
        sgmv_expand(config, h, b, ranks, scales, batch, y, offsets)
        return h, y

    (h_ref, y_ref), (h_tri, y_tri) = run(Backend.NATIVE), run(Backend.TRITON)
    torch.testing.assert_close(h_tri, h_ref, atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(y_tri.float(), y_ref.float(), atol=5e-2, rtol=5e-2)
    print(f"sgmv {dtype}: triton == reference")


def sgmv_bytes(num_tokens, used, n, rank, hidden, widths, elt) -> tuple[int, int]:
    """(shrink, expand) bytes each call must move: activations in and out, the used slots' weights."""
    shrink = num_tokens * hidden * elt + used * n * rank * hidden * elt + num_tokens * n * rank * 4
    expand = num_tokens * n * rank * 4 + used * sum(widths) * rank * elt + 2 * num_tokens * sum(widths) * elt
    return shrink, expand


def bench_sgmv(flush: torch.Tensor | None = None) -> list[dict]:
    """The shrink and the expand alone, the whole K in one share (the raw entry points' layout)."""
    from loraplex.kernels.lora_tiles import LoRATiles
    from loraplex.kernels.sgmv_triton import sgmv_expand_triton, sgmv_shrink_triton

    hidden, rank, widths, dtype = 4096, 16, [4096, 1024, 1024], torch.bfloat16
    print(f"\nSGMV bandwidth, hidden {hidden}, qkv {widths}, rank {rank}, bf16, L2 flushed before each call")
    print(f"{'adapters':>8} {'T':>6} | {'shrink us':>9} {'GB/s':>7} | {'expand us':>9} {'GB/s':>7}")
    rows = []
    for num_adapters in (1, 8, 64):
        for num_tokens in (16, 256, 4096):
            x, a, b, ranks, scales, batch, offsets = sgmv_case(num_tokens, num_adapters, rank, hidden, widths, dtype)
            n = len(widths)
            tiles = LoRATiles.plan(hidden, offsets, rank, split=False)
            h = torch.zeros(num_tokens, a.shape[1], device="cuda")
            y = torch.zeros(num_tokens, offsets[-1], device="cuda", dtype=dtype)
            ranks_t = torch.tensor(ranks, device="cuda", dtype=torch.int32)
            scales_t = torch.tensor(scales, device="cuda")
            offsets_t = torch.tensor(offsets, device="cuda", dtype=torch.int32)  # as the engine keeps it
            t_s = cuda_time(lambda: sgmv_shrink_triton(x, a, ranks_t, batch, h, tiles), flush=flush)
            t_e = cuda_time(lambda: sgmv_expand_triton(h, b, ranks_t, scales_t, batch, y, offsets_t, tiles),
                            flush=flush)
            shrink_bytes, expand_bytes = sgmv_bytes(num_tokens, min(num_adapters, num_tokens), n, rank, hidden,
                                                    widths, 2)
            print(f"{num_adapters:>8} {num_tokens:>6} | {t_s * 1e6:>9.1f} {shrink_bytes / t_s / 1e9:>7.0f} | "
                  f"{t_e * 1e6:>9.1f} {expand_bytes / t_e / 1e9:>7.0f}")
            rows.append({"adapters": num_adapters, "tokens": num_tokens, "shrink_gbs": shrink_bytes / t_s / 1e9,
                         "expand_gbs": expand_bytes / t_e / 1e9})
    return rows


# Llama-3.1-8B's LoRA projections: (in features, slice widths)
LORA_PROJECTIONS = {"qkv": (4096, [4096, 1024, 1024]), "o": (4096, [4096]), "gate_up": (4096, [14336, 14336]),
                    "down": (14336, [4096])}


def decode_lora_case(num_adapters: int, batch: int, in_features: int, widths: list[int], tune, device="cuda"):
    """A decode step's delta on one projection as the engine runs it: stacked rank-16 slots, tokens grouped on
    the device as the decode graphs group them, a token per adapter in turn."""
    from loraplex.kernels.lora_tiles import LoRATiles
    from loraplex.kernels.sgmv import StackedLoRA

    offsets = [0]
    for w in widths:
        offsets.append(offsets[-1] + w)
    table = StackedLoRA.empty(num_adapters, offsets, in_features, 16, torch.bfloat16, torch.device(device))
    g = torch.Generator(device=device).manual_seed(0)
    table.a.normal_(generator=g)
    table.b.normal_(generator=g)
    table.ranks[:num_adapters] = 16
    table.scales[:num_adapters] = 0.5
    table.tiles = LoRATiles.plan(in_features, offsets, 16, tune)
    slots = torch.arange(batch, device=device, dtype=torch.int32) % num_adapters
    lora_batch = LoRABatch.grouped(slots, num_adapters)
    x = torch.randn(batch, in_features, device=device, dtype=torch.bfloat16, generator=g)
    y = torch.zeros(batch, offsets[-1], device=device, dtype=torch.bfloat16)
    used = min(num_adapters, batch)
    nbytes = used * 16 * 2 * (len(widths) * in_features + offsets[-1]) + batch * 2 * (in_features + 2 * offsets[-1])
    return table, lora_batch, x, y, nbytes


def bench_lora_decode(flush: torch.Tensor | None = None, tune=None, cases=((64, 64), (8, 64), (8, 16))) -> list[dict]:
    """Shrink + expand of a decode step on each 8B projection: device time and the bandwidth of the bytes it
    must move (the used adapters' A and B, x, y read and written)."""
    from loraplex.kernels.lora_tiles import tune_for
    from loraplex.kernels.sgmv import sgmv_lora_stacked_triton

    tune = tune or tune_for(torch.cuda.get_device_name())  # what the engine runs on this card
    rows = []
    for num_adapters, batch in cases:
        for name, (in_features, widths) in LORA_PROJECTIONS.items():
            table, lora_batch, x, y, nbytes = decode_lora_case(num_adapters, batch, in_features, widths, tune)
            t = cuda_time(lambda: sgmv_lora_stacked_triton(x, table, lora_batch, y), iters=50, flush=flush)
            rows.append({"adapters": num_adapters, "batch": batch, "projection": name, "us": t * 1e6,
                         "gbs": nbytes / t / 1e9})
    return rows


TUNE_CANDIDATES = dict(k_share=(512, 1024, 2048), max_splits=(4, 8, 16), block_n=(64, 128, 256),
                       segment_programs=(8, 16, 32, 64, 128))


def tune_lora(flush: torch.Tensor | None = None) -> tuple[object, float]:
    """Each candidate `LoRATune` (one field varied at a time from this card's entry) timed on the decode cases: the
    one with the least total device time, and that time (us per layer, all four projections, summed over the
    cases). Its repr is the `TUNED` entry for this card (`kernels/lora_tiles.py`)."""
    import dataclasses

    from loraplex.kernels.lora_tiles import tune_for

    start = tune_for(torch.cuda.get_device_name())
    candidates = [start] + [dataclasses.replace(start, **{field: value})
                            for field, values in TUNE_CANDIDATES.items() for value in values
                            if getattr(start, field) != value]
    timed = [(sum(r["us"] for r in bench_lora_decode(flush, tune)), tune) for tune in candidates]
    best_us, best = min(timed, key=lambda pair: pair[0])
    return best, best_us


def attention_case(batch, q_len, ctx, heads, kv_heads, dim, block_size, dtype, device="cuda"):
    g = torch.Generator(device=device).manual_seed(0)
    blocks_per = -(-(ctx + q_len) // block_size)
    num_blocks = batch * blocks_per
    kc = torch.randn(num_blocks, block_size, kv_heads, dim, device=device, dtype=dtype, generator=g)
    vc = torch.randn_like(kc)
    perm = torch.randperm(num_blocks, device=device, generator=g)
    tables = perm.view(batch, blocks_per)
    q = torch.randn(batch * q_len, heads, dim, device=device, dtype=dtype, generator=g)
    seq_lens = torch.full((batch,), ctx + q_len, device=device)
    starts = torch.arange(batch + 1, device=device) * q_len
    meta = PagedAttentionMetadata.build(torch.zeros(batch * q_len, dtype=torch.long, device=device),
                                        tables, seq_lens, starts, block_size, q_len, ctx + q_len)
    return q, kc, vc, meta, tables


def check_attention(dtype) -> None:
    reference, triton = (attention_kernel(KernelConfig(backend=backend, device_type="cuda", dtype=dtype,
                                                       kv_dtype=dtype)) for backend in (Backend.NATIVE, Backend.TRITON))
    for q_len, ctx in ((1, 300), (37, 100)):
        q, kc, vc, meta, _ = attention_case(6, q_len, ctx, HEADS, KV_HEADS, HEAD_DIM, 16, dtype)
        ref = reference(q, kc, vc, meta, HEAD_DIM ** -0.5)
        tri = triton(q, kc, vc, meta, HEAD_DIM ** -0.5)
        torch.testing.assert_close(tri.float(), ref.float(), atol=2e-2, rtol=2e-2)
    print(f"paged attention {dtype}: triton == reference (decode and prefill chunks)")


def contiguous_kv(kc, vc, tables, length: int, repeat: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, Hkv * repeat, L, D] copies of the paged K/V (repeat: KV heads expanded for a backend without GQA)."""
    k = kc[tables].flatten(1, 2)[:, :length].transpose(1, 2).repeat_interleave(repeat, 1).contiguous()
    v = vc[tables].flatten(1, 2)[:, :length].transpose(1, 2).repeat_interleave(repeat, 1).contiguous()
    return k, v


def sdpa_call(batch, q_len, ctx, q, kc, vc, tables):
    """SDPA on contiguous K/V with the mask each case needs and no boolean tensor (which rules out flash):
    decode none, a fresh prompt `is_causal`, a chunk after context the lower-right causal bias (efficient
    backend, which has no GQA: K/V heads expanded, outside the timer)."""
    qq = q.view(batch, q_len, HEADS, HEAD_DIM).transpose(1, 2)
    if q_len == 1 or ctx == 0:
        k, v = contiguous_kv(kc, vc, tables, ctx + q_len)
        return lambda: F.scaled_dot_product_attention(qq, k, v, is_causal=ctx == 0 and q_len > 1, enable_gqa=True)
    from torch.nn.attention.bias import causal_lower_right

    k, v = contiguous_kv(kc, vc, tables, ctx + q_len, HEADS // KV_HEADS)
    bias = causal_lower_right(q_len, ctx + q_len)
    return lambda: F.scaled_dot_product_attention(qq, k, v, attn_mask=bias)


def bench_attention(flush: torch.Tensor | None = None) -> list[dict]:
    print(f"\nPaged attention (Triton) vs SDPA on contiguous K/V, {HEADS} heads / {KV_HEADS} KV heads, dim "
          f"{HEAD_DIM}, bf16")
    print(f"{'batch':>5} {'q':>4} {'ctx':>6} | {'paged us':>9} {'sdpa us':>9} {'ratio':>6}")
    kernel = PagedAttention(HEAD_DIM ** -0.5, KernelConfig(backend=Backend.TRITON, device_type="cuda",
                                                           dtype=torch.bfloat16, kv_dtype=torch.bfloat16))
    rows = []
    for batch, q_len, ctx in ((64, 1, 1024), (64, 1, 4096), (8, 512, 0), (8, 512, 2048)):
        q, kc, vc, meta, tables = attention_case(batch, q_len, ctx, HEADS, KV_HEADS, HEAD_DIM, 16, torch.bfloat16)
        t_paged = cuda_time(lambda: kernel(q, kc, vc, meta), flush=flush)
        t_sdpa = cuda_time(sdpa_call(batch, q_len, ctx, q, kc, vc, tables), flush=flush)
        print(f"{batch:>5} {q_len:>4} {ctx:>6} | {t_paged * 1e6:>9.1f} {t_sdpa * 1e6:>9.1f} {t_paged / t_sdpa:>6.2f}")
        rows.append({"batch": batch, "q": q_len, "ctx": ctx, "paged_us": t_paged * 1e6, "sdpa_us": t_sdpa * 1e6})
    return rows


def bench_prefill(flush: torch.Tensor | None = None, cases=((1, 512), (1, 2048), (1, 8192), (4, 2048))) -> list[dict]:
    """Fresh prompts through the engine's two prefill choices, each a `PagedAttention` built once."""
    config = KernelConfig(backend=Backend.TRITON, device_type="cuda", dtype=torch.bfloat16, kv_dtype=torch.bfloat16)
    layers = {name: PagedAttention(HEAD_DIM ** -0.5, config, prefill=name) for name in ("triton", "sdpa")}
    print(f"\nPrefill attention, fresh prompts: paged Triton vs SDPA (is_causal), {HEADS}/{KV_HEADS} heads, bf16")
    print(f"{'batch':>5} {'len':>6} | {'triton us':>9} {'sdpa us':>9} {'sdpa speed-up':>13}")
    rows = []
    for batch, length in cases:
        q, kc, vc, meta, _ = attention_case(batch, length, 0, HEADS, KV_HEADS, HEAD_DIM, 16, torch.bfloat16)
        times = {name: cuda_time(lambda layer=layer: layer(q, kc, vc, meta), flush=flush)
                 for name, layer in layers.items()}
        ratio = times["triton"] / times["sdpa"]
        print(f"{batch:>5} {length:>6} | {times['triton'] * 1e6:>9.1f} {times['sdpa'] * 1e6:>9.1f} {ratio:>12.2f}x")
        rows.append({"batch": batch, "length": length, "triton_us": times["triton"] * 1e6,
                     "sdpa_us": times["sdpa"] * 1e6})
    return rows


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing measured")
        return 1
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for dtype in (torch.bfloat16, torch.float16):
        check_sgmv(dtype)
        check_attention(dtype)
    flush = flush_buffer()
    bench_sgmv(flush)
    for row in bench_lora_decode(flush):
        print(f"LoRA decode, {row['adapters']} adapters, batch {row['batch']}, {row['projection']}: "
              f"{row['us']:.1f} us, {row['gbs']:.0f} GB/s")
    if "--tune-lora" in sys.argv:
        best, best_us = tune_lora(flush)
        print(f"best LoRA tiles on {torch.cuda.get_device_name()}: {best!r} ({best_us:.0f} us over the cases)")
    bench_attention(flush)
    bench_prefill(flush)
    return 0


if __name__ == "__main__":
    sys.exit(main())
