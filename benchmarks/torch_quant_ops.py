"""Torch's own quantized CPU ops vs ours, on one decode step's projections (issue #38).

The default model's 120 projection calls (SmolLM2-135M: 30 layers x qkv 960x576, o 576x576, gate_up
3072x576, down 576x1536; random weights, each layer's its own, so they come from memory as in the
engine) and, as a separate row, the LM head 49152x576, at each token count, every candidate taking
turns within a round (the start rotating), best and median of `--rounds` rounds, ms per step:
- q4: ours (`quant.quantize(W, "q4")` kept as the engine keeps it, `quant.for_this_cpu`, and multiplied
  as the engine multiplies it: through the `quant.plan` built once per weight from this machine's
  `KernelConfig`; `quant.quantized_matmul` would build one per call) vs
  `torch.ops.aten._weight_int4pack_mm_for_cpu` on the same nibbles and scales (packed once by
  `_convert_weight_to_int4pack_for_cpu`, groups of 32; torch dequantizes (q - 8) * scale + zero, so
  scale = d and zero = m + 8 d give our Q4_1's d * q + m);
- int8 per output channel: ours (`quant.quantize(W, "q8")`) vs `torch.ops.aten._weight_int8pack_mm`
  on the same int8 values and scales (ours through its plan likewise);
- dense reference points (float32 x only): the dequantized q4 weight reordered for oneDNN
  (`mkldnn._reorder_linear_weight` + `_linear_pointwise`, as the packed float32 linear does) and `F.linear` on it.
Activations in float32 and in bfloat16 (torch's ops take bf16 x only with bf16 scales: their scales
and zeros are rounded to bf16 there). Numerics: each candidate's largest |difference| from
`quant.reference_matmul` on one layer's four weights (and the head), per token count.

    .venv/bin/python benchmarks/torch_quant_ops.py [--tokens 1 16 64 --rounds 3 --no-head]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from loraplex.kernels import dispatch, quant

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of qkv, o, gate_up, down
HEAD = (49152, 576)
LAYERS = 30
WITHIN = 1.10  # the bar: how much slower than ours torch's op may be


@dataclass
class Weight:
    """One projection's weight in every candidate's format."""
    q4: quant.QuantizedWeight
    q8: quant.QuantizedWeight
    q4_plan: quant.QuantPlan
    q8_plan: quant.QuantPlan
    int4pack: torch.Tensor
    scales_zeros: dict[torch.dtype, torch.Tensor]
    int8_scales: dict[torch.dtype, torch.Tensor]
    onednn: torch.Tensor
    dense: torch.Tensor


def q4_values(w: quant.QuantizedWeight) -> torch.Tensor:
    """The q4 weight's values q [N, K] in 0..15, unpacked from GGUF's nibble order."""
    w = quant.unpack_tiles(w)
    n, k = w.shape
    packed = w.q.reshape(n, k // quant.Q4_GROUP, quant.Q4_GROUP // 2)
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1).reshape(n, k)


def torch_int4(w: quant.QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """Our q4 in torch's int4 CPU layout: the packed nibbles, and scales_and_zeros [K / 32, N, 2]."""
    rows = quant.unpack_tiles(w)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4_values(rows).to(torch.int32), 2)
    scales_zeros = torch.stack([rows.d.T, (rows.m + 8 * rows.d).T], dim=-1).contiguous()
    return packed, scales_zeros


def engine_config() -> dispatch.KernelConfig:
    """The kernel choices an engine on this CPU resolves once (caps, the machine's tune table)."""
    return dispatch.kernel_config(torch.device("cpu"), torch.float32)


def make_weight(n: int, k: int, gen: torch.Generator, config: dispatch.KernelConfig) -> Weight:
    """As `QuantizedLinear.process_weights_after_loading` keeps and plans it, plus torch's formats."""
    full = torch.randn(n, k, generator=gen) * 0.02
    q4 = quant.for_this_cpu(quant.quantize(full, "q4"), config.backend == dispatch.Backend.CPU and config.caps.amx)
    q8 = quant.quantize(full, "q8")
    plan = lambda w: quant.plan(w, config.tune, config.caps)  # noqa: E731
    packed, scales_zeros = torch_int4(q4)
    dense = quant.dequantize(q4)
    scales = q8.d[:, 0].contiguous()
    dtypes = (torch.float32, torch.bfloat16)
    return Weight(q4, q8, plan(q4), plan(q8), packed, {d: scales_zeros.to(d) for d in dtypes},
                  {d: scales.to(d) for d in dtypes}, torch.ops.mkldnn._reorder_linear_weight(dense), dense)


def candidates(dtype: torch.dtype) -> dict[str, Callable[[torch.Tensor, Weight], torch.Tensor]]:
    """name -> call(x, weight), for x of `dtype`."""
    calls = {
        "q4 ours": lambda x, w: w.q4_plan(x),
        "q4 torch": lambda x, w: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, w.int4pack, quant.Q4_GROUP, w.scales_zeros[x.dtype]),
        "int8 ours": lambda x, w: w.q8_plan(x),
        "int8 torch": lambda x, w: torch.ops.aten._weight_int8pack_mm(x, w.q8.q, w.int8_scales[x.dtype]),
    }
    if dtype == torch.float32:
        calls["oneDNN f32"] = lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w.onednn, None, "none", [], "")
        calls["F.linear f32"] = lambda x, w: F.linear(x, w.dense)
    return calls


def reference(name: str, x: torch.Tensor, w: Weight, int8_x: bool = False) -> torch.Tensor:
    return quant.reference_matmul(x, w.q8 if name.startswith("int8") else w.q4, int8_activations=int8_x)


def max_errors(calls: dict, x: dict[int, torch.Tensor], weights: list[Weight]) -> dict[str, float]:
    """Each candidate's largest |output - quant.reference_matmul| over `weights`; ours also against the
    reference with x rounded to int8 as our decode-sized calls round it."""
    def error(name: str, w: Weight, int8_x: bool) -> float:
        xs = x[w.dense.shape[1]]
        return (calls[name](xs, w).float() - reference(name, xs, w, int8_x)).abs().max().item()

    checks = [(name, False) for name in calls] + [(name, True) for name in calls if name.endswith("ours")]
    return {f"{name}{' vs int8-x ref' if int8_x else ''}": max(error(name, w, int8_x) for w in weights)
            for name, int8_x in checks}


def step_seconds(call: Callable, x: dict[int, torch.Tensor], layers: list[list[Weight]]) -> float:
    start = time.perf_counter()
    for layer in layers:
        for w in layer:
            call(x[w.dense.shape[1]], w)
    return time.perf_counter() - start


def measure(calls: dict, x: dict[int, torch.Tensor], layers: list[list[Weight]],
            rounds: int) -> dict[str, list[float]]:
    """Seconds per round and candidate, the candidates taking turns (the first one rotating), after one
    warm-up call each (a whole warm-up round of torch's slowest ops would take minutes)."""
    names = list(calls)
    for name in names:
        step_seconds(calls[name], x, [layers[0]])
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(step_seconds(calls[name], x, layers))
    return times


def cpu_header() -> str:
    info = open("/proc/cpuinfo").read().splitlines()
    model = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), [])
    simd = " ".join(f for f in flags if f.startswith(("avx", "amx")))
    threads = torch.get_num_threads()
    return f"CPU: {model}; flags: {simd or 'no avx / amx'}; torch {torch.__version__}, {threads} threads"


COLUMNS = ["q4 ours", "q4 torch", "int8 ours", "int8 torch", "oneDNN f32", "F.linear f32"]
RATIOS = [("q4 torch", "q4 ours"), ("int8 torch", "int8 ours"), ("oneDNN f32", "q4 ours"), ("F.linear f32", "q4 ours")]


def table_header() -> str:
    ratios = [f"{a} / {b}" for a, b in RATIOS]
    cells = ["what", "tokens", "x", *COLUMNS, *ratios]
    return "| " + " | ".join(cells) + " |\n|" + " --- |" * len(cells)


def row(what: str, tokens: int, dtype: torch.dtype, times: dict[str, list[float]]) -> str:
    """ms as best (median); ratios of the bests (of the medians)."""
    best = {name: min(t) for name, t in times.items()}
    med = {name: statistics.median(t) for name, t in times.items()}
    cells = [f"{1e3 * best[c]:.2f} ({1e3 * med[c]:.2f})" if c in times else "-" for c in COLUMNS]
    cells += [f"{best[a] / best[b]:.2f} ({med[a] / med[b]:.2f})" if a in times else "-" for a, b in RATIOS]
    return f"| {what} | {tokens} | {str(dtype).removeprefix('torch.')} | " + " | ".join(cells) + " |"


def verdicts(results: list[tuple[str, int, torch.dtype, dict]]) -> list[str]:
    lines = []
    for what, tokens, dtype, times in results:
        for torch_op, ours in RATIOS[:2]:
            ratio = min(times[torch_op]) / min(times[ours])
            verdict = "yes" if ratio <= WITHIN else "no"
            lines.append(f"{what}, {tokens} tokens, {str(dtype).removeprefix('torch.')} x: {torch_op} / {ours} = "
                         f"{ratio:.2f}: within 10% of ours: {verdict}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-head", action="store_true", help="skip the LM head row")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    config = engine_config()
    layers = [[make_weight(n, k, gen, config) for n, k in SHAPES] for _ in range(LAYERS)]
    head = [] if args.no_head else [("LM head", [[make_weight(*HEAD, gen, config)]])]
    groups = [("120 projections", layers), *head]
    print(cpu_header())
    print(f"ours: q4 {layers[0][0].q4_plan.describe()}; int8 {layers[0][0].q8_plan.describe()} (tokens)")
    print(f"command: .venv/bin/python {' '.join(sys.argv)}")
    print(f"ms per step, best (median) of {args.rounds} rounds, candidates taking turns; ratios of the bests "
          f"(of the medians)\n")
    results, errors = [], []
    with torch.inference_mode():
        for tokens in args.tokens:
            for dtype in (torch.float32, torch.bfloat16):
                x = {k: torch.randn(tokens, k, generator=gen).to(dtype) for k in (576, 1536)}
                calls = candidates(dtype)
                for what, weights in groups:
                    results.append((what, tokens, dtype, measure(calls, x, weights, args.rounds)))
                    errors.append((what, tokens, dtype, max_errors(calls, x, weights[0])))
    print(table_header())
    for result in results:
        print(row(*result))
    print("\nmax |output - quant.reference_matmul| (one layer's weights, or the head):")
    for what, tokens, dtype, errs in errors:
        print(f"{what}, {tokens} tokens, {str(dtype).removeprefix('torch.')} x: "
              + ", ".join(f"{name} {e:.2e}" for name, e in errs.items()))
    print("\n" + "\n".join(verdicts(results)))


if __name__ == "__main__":
    main()
