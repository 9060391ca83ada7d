"""`dtype="auto"` decided by measurement, not by CPU flags: a short probe of the model's
decode-step matmuls in float32 and in bfloat16 (weights packed as the engine packs them: oneDNN's
bf16 path where the CPU has native bf16, our AMX kernel where it has AMX), once per machine, torch
build, C kernel source and model shape, cached beside the C kernels; the faster wins. Where bf16 is
emulated it loses by several times (BENCHMARKS.md), so the probe is a formality there, but one that
costs a few seconds once.

The probe times the linear layers (one decoder layer's, times the number of layers, plus the
LM head) on a decode batch: at decode sizes they are most of a step, and they are what the
dtype changes most.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from loraplex.platform.config import ModelConfig
from loraplex.platform.models.linear import PackedLinear, can_pack, native_bf16

CANDIDATES = ("float32", "bfloat16")
PROBE_BATCH, PROBE_REPEATS = 16, 5


def resolve_dtype(model: ModelConfig, probe: Callable[[ModelConfig], dict[str, float]] | None = None
                  ) -> tuple[str, str]:
    """The dtype `auto` means for this model on this CPU, and why (for the start-up log)."""
    times = (probe or cached_probe)(model)
    choice = min(times, key=times.get)
    measured = ", ".join(f"{name} {seconds * 1e3:.2f} ms" for name, seconds in sorted(times.items()))
    native = "native" if native_bf16() else "emulated (no AVX512-BF16 / AMX)"
    return choice, f"probe of the decode step's matmuls at batch {PROBE_BATCH}: {measured}; bf16 {native}"


def cached_probe(model: ModelConfig) -> dict[str, float]:
    """`probe_matmuls`, measured once per CPU, torch build, kernel source and model shape."""
    path = _cache_file()
    key = _key(model)
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if isinstance(cached.get(key), dict):
        return cached[key]
    times = probe_matmuls(model)
    cached[key] = times
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cached, indent=1))
    os.replace(tmp, path)  # concurrent engines: the last rename wins, each wrote a whole file
    return times


def probe_matmuls(model: ModelConfig) -> dict[str, float]:
    """Seconds per decode step's linear layers, median of a few, per candidate dtype."""
    hidden, heads, kv_heads, dim = model.hidden_size, model.num_heads, model.num_kv_heads, model.head_dim
    shapes = [(hidden, (heads + 2 * kv_heads) * dim), (heads * dim, hidden), (hidden, 2 * model.intermediate_size),
              (model.intermediate_size, hidden)]
    generator = torch.Generator().manual_seed(0)
    times = {}
    for name in CANDIDATES:
        dtype = getattr(torch, name)
        layers = [_packed(i, o, dtype, generator) for i, o in shapes]
        head = _packed(hidden, model.vocab_size, dtype, generator)
        x = {i: torch.randn(PROBE_BATCH, i, generator=generator).to(dtype) for i, _ in shapes}
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
        times[name] = statistics.median(samples)
    return times


def _packed(in_features: int, out_features: int, dtype: torch.dtype, generator: torch.Generator) -> PackedLinear:
    linear = PackedLinear(in_features, out_features, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=generator) * in_features ** -0.5)
    linear.to(dtype)
    if can_pack(dtype):
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
