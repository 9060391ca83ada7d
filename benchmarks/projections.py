"""One decode step's linear projections, per weight format the engine can keep, in one process.

The default model's 120 projection calls (30 layers x qkv 960x576, o 576x576, gate_up 3072x576,
down 576x1536; random weights of those shapes, q4 with float16 scales as a GGUF's) at each token
count, bf16 x, every format taking turns: "cold" runs the 30 layers' own weights (out of cache, as in
the engine: 212 MB in bf16, 66 MB in q4 in tile order), "hot" one layer's weights 30 times (in cache:
the kernel's arithmetic alone).
Formats: bf16 on the engine's dense path (our AMX tile kernel where it packs, else oneDNN), and
q4 through its `quant.plan` by rows and as the engine keeps it (`quant.for_this_cpu`: in tile
order on AMX). With `--float32` (float32 x): the two float32 layouts `dtype=auto`'s probe chooses
between, packed for oneDNN and plain rows (our C kernel up to the autotune table's `f32_kernel_tokens`, then MKL's
GEMM), and `F.linear` on plain rows (MKL throughout, as transformers runs). Best of `--rounds`, ms.

    .venv/bin/python benchmarks/projections.py [--tokens 1 2 4 16 64 128 --rounds 7] [--float32]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
import torch.nn.functional as F

from loraplex.kernels import autotune, cpu_kernels, quant
from loraplex.kernels.cpu_kernels import CpuCaps
from loraplex.kernels.dispatch import kernel_config
from loraplex.platform.models.linear import Linear

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of qkv, o, gate_up, down
LAYERS = 30


def gguf_like(weight: torch.Tensor) -> quant.QuantizedWeight:
    """q4 with float16 scales, as a GGUF's Q4_1 blocks have them (what the engine serves by default)."""
    w = quant.quantize(weight, "q4")
    return dataclasses.replace(w, d=w.d.half().float(), m=w.m.half().float())


def dense_layer(n: int, k: int, gen: torch.Generator, dtype: torch.dtype = torch.bfloat16,
                pack: bool = True) -> Linear:
    """One layer in the weight format the engine would choose for `dtype` (packed, or plain rows)."""
    kernels = kernel_config(torch.device("cpu"), dtype, pack_weights=pack)
    layer = Linear(k, n, False, kernels).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=gen) * 0.02)
    layer.process_weights_after_loading()
    return layer


def float32_formats(gen: torch.Generator) -> dict[str, list[list]]:
    packed = [[dense_layer(n, k, gen, torch.float32) for n, k in SHAPES] for _ in range(LAYERS)]
    plain = [[dense_layer(n, k, gen, torch.float32, pack=False) for n, k in SHAPES] for _ in range(LAYERS)]
    return {"float32 packed (oneDNN)": [[lambda x, m=m: m(x) for m in layer] for layer in packed],
            "float32 plain rows (ours, then MKL)": [[lambda x, m=m: m(x) for m in layer] for layer in plain],
            "F.linear (MKL)": [[lambda x, m=m: F.linear(x, m.dense_weight()) for m in layer] for layer in plain]}


_CAPS = CpuCaps.detect()
TUNE = autotune.resolve(_CAPS.native_bf16, _CAPS.dpbf16, _CAPS.amx, kernel_seconds=quant.kernel_seconds) \
    if _CAPS.library else autotune.DEFAULT


def bf16_formats(gen: torch.Generator) -> dict[str, list[list]]:
    rows = [[gguf_like(torch.randn(n, k, generator=gen) * 0.02) for n, k in SHAPES] for _ in range(LAYERS)]
    dense = [[dense_layer(n, k, gen) for n, k in SHAPES] for _ in range(LAYERS)]
    caps = CpuCaps.detect()
    kept = [[quant.for_this_cpu(w, caps.amx) for w in layer] for layer in rows]
    return {
        "bf16, dense path": [[lambda x, m=m: m(x) for m in layer] for layer in dense],
        "q4 by rows": [[quant.plan(w, TUNE, caps) for w in layer] for layer in rows],
        f"q4 as kept ({'tile order' if kept[0][0].tiles else 'by rows'})":
            [[quant.plan(w, TUNE, caps) for w in layer] for layer in kept],
    }


def measure(formats: dict[str, list[list]], x: dict[int, torch.Tensor], rounds: int) -> dict[tuple[str, str], float]:
    """Best seconds per (format, cold / hot), the formats taking turns; the first round warms up."""
    best = {(name, side): float("inf") for name in formats for side in ("cold", "hot")}
    for _ in range(rounds + 1):
        for name, calls in formats.items():
            for side, layers in (("cold", range(LAYERS)), ("hot", [0] * LAYERS)):
                start = time.perf_counter()
                for i in layers:
                    for call, (_, k) in zip(calls[i], SHAPES):
                        call(x[k])
                best[name, side] = min(best[name, side], time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 16, 64, 128])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--float32", action="store_true", help="the float32 layouts (float32 x)")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    dtype = torch.float32 if args.float32 else torch.bfloat16
    formats = float32_formats(gen) if args.float32 else bf16_formats(gen)
    print(f"120 projections of one decode step, {str(dtype).removeprefix('torch.')} x, "
          f"{torch.get_num_threads()} threads, AMX: "
          f"{cpu_kernels.amx_supported()}; best of {args.rounds} rounds, ms (cold: 30 layers' weights; hot: one "
          f"layer's 30 times)\n")
    print("| tokens | " + " | ".join(f"{name} cold | hot" for name in formats) + " |")
    print("| --- | " + " | ".join("--- | ---" for _ in formats) + " |")
    for tokens in args.tokens:
        x = {k: torch.randn(tokens, k, generator=gen).to(dtype) for k in (576, 1536)}
        with torch.inference_mode():
            best = measure(formats, x, args.rounds)
        cells = " | ".join(f"{1e3 * best[name, 'cold']:.2f} | {1e3 * best[name, 'hot']:.2f}" for name in formats)
        print(f"| {tokens} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
