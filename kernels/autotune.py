"""Every measured kernel choice in one table, decided once per machine and logged at start-up.

Two kinds of entries:
- thresholds measured by the benchmarks on the CPUs we had (token counts where one kernel overtakes
  another); each field names the section (BENCHMARKS.md, or docs/benchmarks-history.md for past runs) that measured it;
- choices that differ between CPUs of the same flags, measured here by short probes the first time
  (the dense GEMM's dtype for quantized prefill, bf16 dot products against the float kernel, and per
  model shape the dtype / float32 layout that `dtype=auto` means): cached in one file beside the C
  kernels, keyed by the CPU's flags, the torch build and the kernels' source.

The engine resolves the table once (`resolve`) and hands it to whatever it builds; nothing on the
hot path reads it again except through the plans built from it. The quantized kernels read this table
(`quant.py`), so their probe is handed in (`quant.kernel_seconds`) rather than imported.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TuneTable:
    # plain float32 rows: our C kernel up to here, MKL's GEMM beyond ("float32 weights: plain rows and our kernel")
    f32_kernel_tokens: int = 24
    # quantized weights, all "Quantized weights" unless said otherwise:
    # int8 activations and integer dot products up to here (decode at batch 1-4)
    int8_activation_tokens: int = 4
    # from here the weight is dequantized for oneDNN's GEMM, by the GEMM's dtype
    dense_tokens_bf16: int = 32
    dense_tokens_f32: int = 96
    # [low, high) tokens on the AMX tile kernel, by rows ("q4 in bf16 on AMX") and in tile order ("q4 in tile order")
    amx_tokens: tuple[int, int] = (3, 192)
    amx_tile_order_tokens: tuple[int, int] = (1, 320)
    # [low, high) tokens on AVX512-BF16 dot products without AMX ("q4 on AVX512-BF16 without AMX"), where
    # they beat the float kernel by `dpbf16_margin` (a near tie must not flip between runs)
    dpbf16_tokens: tuple[int, int] = (5, 192)
    dpbf16_margin: float = 1.15
    # the multi-LoRA C kernel while a batch's segments average at most this many tokens, by adapter dtype
    # (benchmarks/lora_ops.py, "Multi-LoRA on CPU")
    lora_kernel_mean_segment_f32: int = 64
    lora_kernel_mean_segment_bf16: int = 256
    # paged attention: query chunks up to this long on the C kernel, longer ones on gather + SDPA
    attention_kernel_query_len: int = 32
    # measured here (`measure`): the quantized dense path's GEMM dtype, and whether bf16 dot products win
    dense_dtype: str = "float32"
    dpbf16_wins: bool = False
    measured: dict = field(default_factory=dict, compare=False)  # what the probes saw, for the log

    def dense_tokens(self, dtype: torch.dtype) -> int:
        return self.dense_tokens_bf16 if dtype == torch.bfloat16 else self.dense_tokens_f32

    @property
    def torch_dense_dtype(self) -> torch.dtype:
        return getattr(torch, self.dense_dtype)

    def lines(self) -> list[str]:
        """The table as the start-up log prints it."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "measured"}
        out = [" ".join(f"{name}={value}" for name, value in values.items())]
        out += [f"{name}: {what}" for name, what in self.measured.items()]
        return out


DEFAULT = TuneTable()


# ---- the probes ---------------------------------------------------------------------------------------------

def gemm_seconds(dtypes: tuple[torch.dtype, ...], tokens: int = 256, size: int = 1024, rounds: int = 4
                 ) -> dict[torch.dtype, float]:
    """The best of `rounds` prefill-sized GEMMs per dtype, the dtypes taking turns (noise hits both)."""
    gen = torch.Generator().manual_seed(0)  # the global RNG is the user's
    pairs = {d: (torch.randn(tokens, size, generator=gen).to(d), torch.randn(size, size, generator=gen).to(d))
             for d in dtypes}
    best = {d: float("inf") for d in dtypes}
    for _ in range(rounds + 1):  # the first round warms oneDNN up
        for d, (x, w) in pairs.items():
            start = time.perf_counter()
            F.linear(x, w)
            best[d] = min(best[d], time.perf_counter() - start)
    return best


def _ms(times: dict) -> str:
    return ", ".join(f"{str(k).removeprefix('torch.')} {t * 1e3:.2f} ms" for k, t in times.items())


def measure_dense_dtype(native_bf16: bool, seconds: Callable | None = None) -> tuple[str, str]:
    """The quantized dense path's GEMM dtype: bfloat16 only where native and measured faster than float32
    (native is not enough: on AVX512-BF16 without AMX float32 won, "Quantized weights")."""
    if not native_bf16:
        return "float32", "bf16 emulated: not measured"
    times = (seconds or gemm_seconds)((torch.float32, torch.bfloat16))
    return str(min(times, key=times.get)).removeprefix("torch."), _ms(times)


def measure_dpbf16(dpbf16: bool, amx: bool, margin: float, seconds: Callable[[], dict[str, float]]
                   ) -> tuple[bool, str]:
    """Whether bf16 dot products beat the float kernel at mid-size calls by `margin` (only asked where the
    library has them and no AMX takes those calls instead); `seconds()` times both (`quant.kernel_seconds`)."""
    if not dpbf16 or amx:
        return False, "not asked (no AVX512-BF16 kernel, or AMX takes those calls)"
    times = seconds()
    return times["bf16 dot-product"] * margin < times["float"], _ms(times)


# ---- dtype=auto: the model's decode-step matmuls in each candidate format ------------------------------------

# name -> (dtype, weights packed); "float32 plain": plain rows, our C kernel at decode sizes
DTYPE_CANDIDATES = {"float32": (torch.float32, True), "float32 plain": (torch.float32, False),
                    "bfloat16": (torch.bfloat16, True)}
PROBE_BATCHES, PROBE_REPEATS = (1, 16, 64), 5


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    layers: int

    def projections(self) -> list[tuple[int, int]]:
        """(in, out) of one decoder layer's linears: qkv, o, gate_up, down."""
        return [(self.hidden, (self.heads + 2 * self.kv_heads) * self.head_dim), (self.heads * self.head_dim,
                self.hidden), (self.hidden, 2 * self.intermediate), (self.intermediate, self.hidden)]


def probe_matmuls(shape: ModelShape, make_linear: Callable) -> dict[str, list[float]]:
    """Seconds per decode step's linear layers at each of `PROBE_BATCHES`, median of a few, per candidate.
    `make_linear(in, out, dtype, packed, generator)` builds one layer as the engine would."""
    generator = torch.Generator().manual_seed(0)
    times = {}
    for name, (dtype, packed) in DTYPE_CANDIDATES.items():
        layers = [make_linear(i, o, dtype, packed, generator) for i, o in shape.projections()]
        head = make_linear(shape.hidden, shape.vocab, dtype, packed, generator)
        times[name] = [_step_seconds(shape, layers, head, batch, dtype, generator) for batch in PROBE_BATCHES]
    return times


def _step_seconds(shape: ModelShape, layers, head, batch: int, dtype: torch.dtype, generator) -> float:
    inputs = {i: torch.randn(batch, i, generator=generator).to(dtype) for i, _ in shape.projections()}
    samples = []
    with torch.inference_mode():
        for repeat in range(PROBE_REPEATS + 2):  # two warm-ups
            start = time.perf_counter()
            for layer, (i, _) in zip(layers, shape.projections()):
                layer(inputs[i])
            layer_time = time.perf_counter() - start
            start = time.perf_counter()
            head(inputs[shape.hidden])
            if repeat >= 2:
                samples.append(layer_time * shape.layers + time.perf_counter() - start)
    return statistics.median(samples)


def choose_dtype(times: dict[str, list[float]]) -> tuple[str, bool, str]:
    """(dtype, weights packed, why): the candidate whose three times multiply to the least, so that each
    batch size counts alike (a layout faster at batch 1 by a larger factor than it is slower at 64 wins)."""
    choice = min(times, key=lambda name: math.prod(times[name]))
    measured = ", ".join(f"{name} {' + '.join(f'{s * 1e3:.2f}' for s in times[name])} ms" for name in sorted(times))
    dtype, packed = DTYPE_CANDIDATES[choice]
    batches = " + ".join(str(batch) for batch in PROBE_BATCHES)
    return (str(dtype).removeprefix("torch."), packed,
            f"probe of the decode step's matmuls at batch {batches}: {measured}")


# ---- the cache ------------------------------------------------------------------------------------------------

def cache_file() -> Path:
    root = os.environ.get("LORAPLEX_CACHE") or Path.home() / ".cache" / "loraplex"
    return Path(root) / "autotune.json"


def machine_key() -> str:
    """What the measurements depend on: this CPU, the torch build and our kernels' source."""
    from loraplex.kernels import cpu_kernels

    return hashlib.sha256(cpu_kernels._cpu_flags() + torch.__version__.encode() +
                          cpu_kernels.source_digest()).hexdigest()[:16]


def cached(entry: str, measure: Callable[[], object]) -> object:
    """`measure()`'s JSON-able result, measured once per machine key and entry."""
    path, key = cache_file(), f"{machine_key()}/{entry}"
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        stored = {}
    if key in stored:
        return stored[key]
    value = measure()
    stored[key] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(stored, indent=1))
    os.replace(tmp, path)  # concurrent engines: the last rename wins, each wrote a whole file
    return value


def resolve(native_bf16: bool, dpbf16: bool, amx: bool, base: TuneTable | None = None, *,
            kernel_seconds: Callable[[], dict[str, float]]) -> TuneTable:
    """The table for this machine: `base`'s thresholds (`DEFAULT`'s) plus the probes' choices (cached).
    `kernel_seconds` times the quantized kernels the table chooses between (`quant.kernel_seconds`: handed in,
    since those kernels read this table)."""
    base = base or DEFAULT
    dense, dense_why = cached("dense_dtype", lambda: list(measure_dense_dtype(native_bf16)))
    wins, wins_why = cached("dpbf16_wins",
                            lambda: list(measure_dpbf16(dpbf16, amx, base.dpbf16_margin, kernel_seconds)))
    return dataclasses.replace(base, dense_dtype=dense, dpbf16_wins=bool(wins),
                               measured={"dense_dtype": dense_why, "dpbf16_wins": wins_why})


def resolve_dtype(shape: ModelShape, make_linear: Callable, native_bf16: bool,
                  probe: Callable[[ModelShape, Callable], dict] | None = None) -> tuple[str, bool, str]:
    """What `dtype=auto` means for this model shape here: (dtype, float32 weights packed, why)."""
    probe = probe or probe_matmuls
    times = cached(f"dtype/{json.dumps(dataclasses.astuple(shape))}", lambda: probe(shape, make_linear))
    dtype, packed, why = choose_dtype(times)
    return dtype, packed, why + ("; bf16 native" if native_bf16 else "; bf16 emulated (no AVX512-BF16 / AMX)")
