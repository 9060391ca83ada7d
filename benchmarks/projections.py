"""One decode step's linear projections, per weight format the engine can keep, in one process.

The default model's 120 projection calls (30 layers x qkv 960x576, o 576x576, gate_up 3072x576,
down 576x1536; random weights of those shapes, q4 with float16 scales as a GGUF's) at each token
count, bf16 x, every format taking turns: "cold" runs the 30 layers' own weights (out of cache, as in
the engine: 212 MB in bf16, 66 MB in q4 in tile order), "hot" one layer's weights 30 times (in cache:
the kernel's arithmetic alone).
Formats: bf16 on the engine's dense path (our AMX tile kernel where it packs, else oneDNN), and
q4 through `quantized_matmul` by rows and as the engine keeps it (`quant.for_this_cpu`: in tile
order on AMX). Best of `--rounds`, ms.

    .venv/bin/python benchmarks/projections.py [--tokens 1 2 4 16 64 128 --rounds 7]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from loraplex.kernels import cpu_kernels, quant
from loraplex.platform.models.linear import PackedLinear

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of qkv, o, gate_up, down
LAYERS = 30


def gguf_like(weight: torch.Tensor) -> quant.QuantizedWeight:
    """q4 with float16 scales, as a GGUF's Q4_1 blocks have them (what the engine serves by default)."""
    w = quant.quantize(weight, "q4")
    return dataclasses.replace(w, d=w.d.half().float(), m=w.m.half().float())


def dense_layer(n: int, k: int, gen: torch.Generator) -> PackedLinear:
    layer = PackedLinear(k, n, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=gen) * 0.02)
    layer.pack()
    return layer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 16, 64, 128])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = [[gguf_like(torch.randn(n, k, generator=gen) * 0.02) for n, k in SHAPES] for _ in range(LAYERS)]
    dense = [[dense_layer(n, k, gen) for n, k in SHAPES] for _ in range(LAYERS)]
    kept = [[quant.for_this_cpu(w) for w in layer] for layer in rows]
    formats = {
        "bf16, dense path": [[lambda x, m=m: m(x) for m in layer] for layer in dense],
        "q4 by rows": [[lambda x, w=w: quant.quantized_matmul(x, w) for w in layer] for layer in rows],
        f"q4 as kept ({'tile order' if kept[0][0].tiles else 'by rows'})":
            [[lambda x, w=w: quant.quantized_matmul(x, w) for w in layer] for layer in kept],
    }
    print(f"120 projections of one decode step, bf16 x, {torch.get_num_threads()} threads, AMX: "
          f"{cpu_kernels.amx_supported()}; best of {args.rounds} rounds, ms (cold: 30 layers' weights; hot: one "
          f"layer's 30 times)\n")
    print("| tokens | " + " | ".join(f"{name} cold | hot" for name in formats) + " |")
    print("| --- | " + " | ".join("--- | ---" for _ in formats) + " |")
    for tokens in args.tokens:
        x = {k: torch.randn(tokens, k, generator=gen).bfloat16() for k in (576, 1536)}
        best = {(name, side): float("inf") for name in formats for side in ("cold", "hot")}
        for _ in range(args.rounds + 1):  # the first round warms up
            for name, calls in formats.items():
                for side, layers in (("cold", range(LAYERS)), ("hot", [0] * LAYERS)):
                    start = time.perf_counter()
                    for i in layers:
                        for call, (_, k) in zip(calls[i], SHAPES):
                            call(x[k])
                    best[name, side] = min(best[name, side], time.perf_counter() - start)
        cells = " | ".join(f"{1e3 * best[name, 'cold']:.2f} | {1e3 * best[name, 'hot']:.2f}" for name in formats)
        print(f"| {tokens} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
