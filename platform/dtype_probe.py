"""`dtype="auto"` decided by measurement, not by CPU flags: a short probe of the model's
decode-step matmuls in bfloat16 (weights packed as the engine packs them: oneDNN's bf16 path where
the CPU has native bf16, our AMX kernel where it has AMX) and in float32 in both of its layouts
(packed for oneDNN, or plain rows that our C kernel streams at decode sizes), once per machine,
torch build, C kernel source and model shape, cached beside the C kernels; the fastest wins. Where
bf16 is emulated it loses by several times (BENCHMARKS.md), so that half of the probe is a
formality there, but one that costs a few seconds once. Which float32 layout is faster differs
between CPUs (BENCHMARKS.md, "float32 weights: plain rows and our kernel"), hence the measurement.

The probe times the linear layers (one decoder layer's, times the number of layers, plus the
LM head) on decode batches of 1, 16 and 64 tokens: at decode sizes the linears are most of a step,
and they are what the dtype and layout change most. The product of a candidate's three times
decides (their geometric mean), so that each batch size counts alike: a layout 1.2x faster at
batch 1 and 1.1x slower at 64 wins.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from loraplex.platform.config import ModelConfig
from loraplex.platform.models.linear import PackedLinear, can_pack, native_bf16

# name -> (dtype, weights packed); "float32 plain": plain rows, our C kernel for decode sizes (`PackedLinear`)
CANDIDATES = {"float32": (torch.float32, True), "float32 plain": (torch.float32, False),
              "bfloat16": (torch.bfloat16, True)}
PROBE_BATCHES, PROBE_REPEATS = (1, 16, 64), 5


def resolve_dtype(model: ModelConfig, probe: Callable[[ModelConfig], dict[str, list[float]]] | None = None
                  ) -> tuple[str, bool, str]:
    """The dtype `auto` means for this model on this CPU, whether its weights are packed, and why (for the
    start-up log)."""
    times = (probe or cached_probe)(model)
    choice = min(times, key=lambda name: math.prod(times[name]))
    measured = ", ".join(f"{name} {' + '.join(f'{seconds * 1e3:.2f}' for seconds in times[name])} ms"
                         for name in sorted(times))
    native = "native" if native_bf16() else "emulated (no AVX512-BF16 / AMX)"
    batches = " + ".join(str(batch) for batch in PROBE_BATCHES)
    dtype, packed = CANDIDATES[choice]
    return (str(dtype).removeprefix("torch."), packed,
            f"probe of the decode step's matmuls at batch {batches}: {measured}; bf16 {native}")


def cached_probe(model: ModelConfig) -> dict[str, list[float]]:
    """`probe_matmuls`, measured once per CPU, torch build, kernel source and model shape."""
    path = _cache_file()
    key = _key(model)
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    entry = cached.get(key)
    if isinstance(entry, dict) and set(entry) == set(CANDIDATES):  # else an older probe's: measure again
        return entry
    times = probe_matmuls(model)
    cached[key] = times
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cached, indent=1))
    os.replace(tmp, path)  # concurrent engines: the last rename wins, each wrote a whole file
    return times


def probe_matmuls(model: ModelConfig) -> dict[str, list[float]]:
    """Seconds per decode step's linear layers at each of `PROBE_BATCHES`, median of a few, per candidate."""
    hidden, heads, kv_heads, dim = model.hidden_size, model.num_heads, model.num_kv_heads, model.head_dim
    shapes = [(hidden, (heads + 2 * kv_heads) * dim), (heads * dim, hidden), (hidden, 2 * model.intermediate_size),
              (model.intermediate_size, hidden)]
    generator = torch.Generator().manual_seed(0)
    times = {}
    for name, (dtype, packed) in CANDIDATES.items():
        layers = [_linear(i, o, dtype, packed, generator) for i, o in shapes]
        head = _linear(hidden, model.vocab_size, dtype, packed, generator)
        times[name] = []
        for batch in PROBE_BATCHES:
            x = {i: torch.randn(batch, i, generator=generator).to(dtype) for i, _ in shapes}
            samples = []
            with torch.inference_mode():
                for repeat in range(PROBE_REPEATS + 2):  # two warm-ups
                    start = time.perf_counter()
                    for layer, (i, _) in zip(layers, shapes):
                        layer(x[i])
                    layer_time = time.perf_counter() - start
                    start = time.perf_counter()
                    head(x[hidden])
                    if repeat >= 2:
                        samples.append(layer_time * model.num_layers + time.perf_counter() - start)
            times[name].append(statistics.median(samples))
    return times


def _linear(in_features: int, out_features: int, dtype: torch.dtype, packed: bool,
            generator: torch.Generator) -> PackedLinear:
    linear = PackedLinear(in_features, out_features, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=generator) * in_features ** -0.5)
    linear.to(dtype).requires_grad_(False)  # as the engine's model: never trained
    if packed and can_pack(dtype):
        linear.pack()
    return linear


def _key(model: ModelConfig) -> str:
    from loraplex.kernels.cpu_kernels import SOURCE, _cpu_flags

    shape = [model.hidden_size, model.num_heads, model.num_kv_heads, model.head_dim, model.intermediate_size,
             model.vocab_size, model.num_layers]
    # the kernels' source too: a bf16 matmul may be ours (AMX), and a new kernel must be measured again
    return hashlib.sha256(_cpu_flags() + torch.__version__.encode() + SOURCE.read_bytes() +
                          json.dumps(shape).encode()).hexdigest()[:16]


def _cache_file() -> Path:
    root = os.environ.get("LORAPLEX_CACHE") or Path.home() / ".cache" / "loraplex"
    return Path(root) / "dtype-probe.json"
