"""CPU multi-LoRA candidates for one fused layer, against the base matmul of that layer.

For 1, 8 and 64 distinct adapters in the batch and T = 16, 64, 256 tokens, times shrink +
expand done several ways and prints each as a multiple of the base layer's own matmul (lower is
better). The first three read a `LoRATable` (each adapter in place, in its own rank: what the
engine uses on CPU); the rest read the stacked layout the Triton kernels use. The winner is what
`kernels/sgmv.py` uses on CPU.

    python benchmarks/lora_ops.py --dtype float32 --rank 16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from loraplex.kernels import cpu_kernels
from loraplex.kernels.dispatch import kernel_config
from loraplex.kernels.lora_batch import LoRABatch
from loraplex.kernels.sgmv import (LoRATable, lora_kernel, sgmv_expand_reference, sgmv_lora_table_torch,
                                   sgmv_shrink_reference)

# SmolLM2-135M's fused qkv projection: 576 -> 576 (q) + 192 (k) + 192 (v)
IN, WIDTHS = 576, [576, 192, 192]


def segment_grouped(x, a, b, ranks, scales, batch, y, offsets, n):
    h = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32)
    sgmv_shrink_reference(x, a, ranks, batch, h, n)
    sgmv_expand_reference(h, b, ranks, scales, batch, y, offsets)


def gather_bmm(x, a, b, ranks, scales, batch, y, offsets, n, slots_t=None):
    """Every token gathers its own A and B and runs a batched matmul (padded to max rank)."""
    keep = slots_t >= 0
    idx = torch.nonzero(keep).flatten()
    s = slots_t[idx]
    h = torch.bmm(a[s], x[idx, :, None])[:, :, 0]  # [N, n*R]
    r = b.shape[2]
    out = torch.empty(len(idx), y.shape[1], dtype=y.dtype)
    for i, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:])):
        out[:, lo:hi] = torch.bmm(b[s, lo:hi], h[:, i * r:(i + 1) * r, None])[:, :, 0]
    y[idx] += out * torch.tensor(scales, dtype=y.dtype)[s][:, None]


def dense_all(x, a, b, ranks, scales, batch, y, offsets, n, slots_t=None):
    """Shrink against every slot's A at once, then pick each token's own columns."""
    S, nr, _ = a.shape
    h_all = (x @ a.reshape(S * nr, -1).T).view(-1, S, nr)
    keep = torch.nonzero(slots_t >= 0).flatten()
    h = h_all[keep, slots_t[keep]]
    s = slots_t[keep]
    r = b.shape[2]
    out = torch.zeros(len(keep), y.shape[1], dtype=y.dtype)
    for i, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:])):
        out[:, lo:hi] = torch.bmm(b[s, lo:hi], h[:, i * r:(i + 1) * r, None])[:, :, 0]
    y[keep] += out * torch.tensor(scales, dtype=y.dtype)[s][:, None]


def rank_grouped(x, a, b, ranks, scales, batch, y, offsets, n):
    """Segments of equal rank share one bmm over the padded segment length."""
    r_max = b.shape[2]
    by_rank: dict[int, list] = {}
    for slot, idx in batch.segments():
        by_rank.setdefault(ranks[slot], []).append((slot, idx))
    for r, segs in by_rank.items():
        for slot, idx in segs:  # on CPU a loop of GEMMs is what bmm does anyway
            xa = x[idx] @ a[slot].view(n, r_max, -1)[:, :r].reshape(n * r, -1).T
            for i, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:])):
                y[idx, lo:hi] += scales[slot] * (xa[:, i * r:(i + 1) * r] @ b[slot, lo:hi, :r].T)


def chosen_cpu_path(x, a, b, ranks, scales, batch, y, offsets, n, table=None, kernel=None):
    """What the engine runs on CPU: `kernels/sgmv.py`'s dispatch over a LoRATable (`lora_kernel`, chosen once)."""
    kernel(x, table, batch, y)


def pytorch_cpu_path(x, a, b, ranks, scales, batch, y, offsets, n, table=None):
    """The PyTorch CPU path alone: one GEMM pair per adapter segment, from the table."""
    sgmv_lora_table_torch(x, table, batch, y)


def c_kernel(x, a, b, ranks, scales, batch, y, offsets, n, table=None):
    """kernels/cpu_kernels.c: each token reads its adapter's A and B in place (float32 or bfloat16)."""
    cpu_kernels.sgmv_lora_table_c(x, table, batch.token_order, batch.order_slots, y)


CANDIDATES = {"dispatch (chosen)": chosen_cpu_path, "C kernel": c_kernel, "pytorch path": pytorch_cpu_path,
              "segment-grouped": segment_grouped, "gather+bmm": gather_bmm, "dense-all-slots": dense_all,
              "rank-grouped": rank_grouped}


def timeit(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    chosen = lora_kernel(kernel_config(torch.device("cpu"), dtype))
    torch.manual_seed(0)
    out = sum(WIDTHS)
    offsets = [0, WIDTHS[0], WIDTHS[0] + WIDTHS[1], out]
    n = len(WIDTHS)
    w = torch.randn(out, IN, dtype=dtype) / IN ** 0.5
    print(f"layer {IN} -> {WIDTHS} (3 slices), rank {args.rank}, {args.dtype}, threads={torch.get_num_threads()}")
    print(f"{'adapters':>8} {'T':>5} {'base ms':>8} | " + " ".join(f"{k:>16}" for k in CANDIDATES))
    for num_adapters in (1, 8, 64):
        a = torch.randn(num_adapters, n * args.rank, IN, dtype=dtype) / IN ** 0.5
        b = torch.randn(num_adapters, out, args.rank, dtype=dtype) / args.rank ** 0.5
        ranks = [args.rank] * num_adapters
        scales = [2.0] * num_adapters
        table = LoRATable.from_stacked(a, b, ranks, scales, offsets)
        for T in (16, 64, 256):
            x = torch.randn(T, IN, dtype=dtype)
            slots = [i % num_adapters for i in range(T)]
            slots_t = torch.tensor(slots)
            batch = LoRABatch.build(slots)
            base = timeit(lambda: x @ w.T, args.repeats)
            cells = []
            for name, fn in CANDIDATES.items():
                y = torch.zeros(T, out, dtype=dtype)
                kw = {"slots_t": slots_t} if name in ("gather+bmm", "dense-all-slots") else \
                    {"table": table, "kernel": chosen} if name == "dispatch (chosen)" else \
                    {"table": table} if name in ("C kernel", "pytorch path") else {}
                t = timeit(lambda: fn(x, a, b, ranks, scales, batch, y, offsets, n, **kw), args.repeats)
                cells.append(f"{t * 1e3:>7.3f}ms {t / base:>5.2f}x")
            print(f"{num_adapters:>8} {T:>5} {base * 1e3:>8.3f} | " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
