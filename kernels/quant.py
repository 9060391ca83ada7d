"""Quantized matmul for CPU: float32 or bfloat16 activations times 4- or 8-bit weights.

Formats (`QuantizedWeight`), both grouped along the input dimension K:
- `q4`: groups of 32, asymmetric, w = d * q + m with q in 0..15 (GGUF Q4_1's math and nibble
  order: byte j of a group holds element j low and element j + 16 high, so GGUF blocks are
  repacked by splitting out their scales, the bits kept as they are).
- `q8`: groups of `group` (32 for GGUF Q8_0, K for per-channel int8), symmetric, w = d * q with q
  in -127..127.

Kernels (`cpu_kernels`), each on one call's x [M, K]: `int8_matmul` (x rounded to int8 per group of 32 and
integer dot products, as llama.cpp does), `float_matmul` (each weight row dequantized once per call into L1,
every token's dot product taken with it), `dense_matmul` (the weight dequantized in C for oneDNN's GEMM),
`amx_matmul` (weight tiles dequantized to bf16 in L1 and multiplied by the tile unit: the dense path's
rounding without its dequantized copy) and `dpbf16_matmul` (the same math on AVX512-BF16 dot products). Which
one takes a call of M tokens is a `QuantPlan`, one table per weight built at load by `plan` from the machine's
`autotune.TuneTable`. On AMX q4 is kept in the tile kernel's order (`for_this_cpu`). Without the C kernels:
the reference, `x @ dequantize(w).T`; tests compare each kernel with the reference that rounds as it does.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from loraplex.kernels import autotune, cpu_kernels
from loraplex.kernels.autotune import TuneTable
from loraplex.kernels.cpu_kernels import KV_KINDS, WEIGHT_KINDS, CpuCaps

Q4_GROUP = 32


@dataclass
class QuantizedWeight:
    kind: str  # "q4" | "q8"
    q: torch.Tensor  # q4: uint8 [N, K / 2]; q8: int8 [N, K]
    d: torch.Tensor  # float32 [N, K / group]
    m: torch.Tensor | None  # q4: float32 [N, K / group]; q8: None
    group: int
    shape: tuple[int, int]  # (N, K) of the float weight
    tiles: bool = False  # q4 in the AMX kernel's order (`pack_tiles`): q, d and m by 16-row tile and group
    # (there d and m may be float16: where that holds every scale exactly, as a GGUF's)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.d, self.m) if t is not None)


def quantize(weight: torch.Tensor, kind: str, group: int | None = None) -> QuantizedWeight:
    """A float weight [N, K] quantized at load: `q4` like llama.cpp's Q4_1 (min/max per group of
    32, scales kept in float32), `q8` symmetric per `group` (default: per channel)."""
    w = weight.detach().float()
    n, k = w.shape
    if kind == "q4":
        if k % Q4_GROUP:
            raise ValueError(f"q4 needs the input dimension to be a multiple of {Q4_GROUP}, got {k}")
        groups = w.reshape(n, k // Q4_GROUP, Q4_GROUP)
        low, high = groups.amin(-1), groups.amax(-1)
        d = (high - low) / 15
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = ((groups - low[..., None]) * inv[..., None] + 0.5).floor().clamp(0, 15).to(torch.uint8)
        return q4_from_values(q.reshape(n, k), d, low)
    if kind == "q8":
        group = group or k
        if k % group or group % 8:
            raise ValueError(f"q8 groups must divide the input dimension {k} and be a multiple of 8, got {group}")
        groups = w.reshape(n, k // group, group)
        d = groups.abs().amax(-1) / 127
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = (groups * inv[..., None]).round().clamp(-127, 127).to(torch.int8)
        return QuantizedWeight("q8", q.reshape(n, k).contiguous(), d.contiguous(), None, group, (n, k))
    raise ValueError(f"unknown quantization {kind!r}")


def q4_from_values(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> QuantizedWeight:
    """q4 from its values q [N, K] in 0..15 and each group of 32's d, m [N, K / 32] (w = d q + m),
    packed in GGUF's nibble order."""
    n, k = q.shape
    groups = q.to(torch.uint8).reshape(n, k // Q4_GROUP, Q4_GROUP)
    packed = groups[..., :16] | (groups[..., 16:] << 4)
    return QuantizedWeight("q4", packed.reshape(n, k // 2).contiguous(), d.float().contiguous(),
                           m.float().contiguous(), Q4_GROUP, (n, k))


def from_gguf(raw: np.ndarray, type_name: str, k: int) -> QuantizedWeight:
    """GGUF blocks as they are in the file (uint8 [N, bytes per row]) for Q4_1 and Q8_0: the
    scales split out (float16 -> float32, exact), the quantized values kept bit for bit."""
    n = raw.shape[0]
    groups = k // 32
    if type_name == "Q4_1":  # per block: d f16, m f16, 16 bytes of nibbles
        blocks = raw.reshape(n, groups, 20)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        q = np.ascontiguousarray(blocks[..., 4:]).reshape(n, k // 2)
        return QuantizedWeight("q4", torch.from_numpy(q.copy()), torch.from_numpy(d), torch.from_numpy(m), 32, (n, k))
    if type_name == "Q8_0":  # per block: d f16, 32 int8
        blocks = raw.reshape(n, groups, 34)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(n, k)
        return QuantizedWeight("q8", torch.from_numpy(q.copy()), torch.from_numpy(d), None, 32, (n, k))
    raise ValueError(f"GGUF tensors of type {type_name} are not kept quantized (Q4_1 and Q8_0 are)")


def pack_tiles(w: QuantizedWeight) -> QuantizedWeight:
    """A q4 weight in the order the AMX kernel reads it: per 16 rows (N padded with zero rows) and group
    of 32, the 16 rows' nibbles (256 bytes) together, and their d and m. Row by row, a 16-row tile's
    group sat in 16 rows' separate cache lines (and 32 more for d and m): from memory the kernel
    waited on them (7 GB/s); tile by tile it reads one sequential stream (BENCHMARKS.md, "q4 in tile
    order"). Same bits and scales: no values change; d and m are kept in float16 where that holds every
    one exactly (a GGUF's own scales), 1/6 fewer bytes a call reads (1.1x at decode sizes)."""
    if w.kind != "q4" or w.tiles:
        raise ValueError(f"only a q4 weight by rows is packed into tiles, not {w.kind}{' tiles' if w.tiles else ''}")
    (n, k), groups = w.shape, w.shape[1] // 32
    padded = -(-n // 16) * 16

    def by_tile(t: torch.Tensor, width: int) -> torch.Tensor:
        full = torch.zeros(padded, groups * width, dtype=t.dtype)
        full[:n] = t
        return full.reshape(padded // 16, 16, groups, width).transpose(1, 2).contiguous()

    d, m = by_tile(w.d, 1)[..., 0], by_tile(w.m, 1)[..., 0]
    if torch.equal(d.half().float(), d) and torch.equal(m.half().float(), m):
        d, m = d.half(), m.half()
    return QuantizedWeight("q4", by_tile(w.q, 16), d, m, w.group, w.shape, tiles=True)


def unpack_tiles(w: QuantizedWeight) -> QuantizedWeight:
    """`pack_tiles`'s inverse: the weight by rows."""
    if not w.tiles:
        return w
    (n, k), groups = w.shape, w.shape[1] // 32

    def by_row(t: torch.Tensor, width: int) -> torch.Tensor:
        return t.reshape(-1, groups, 16, width).transpose(1, 2).reshape(-1, groups * width)[:n].contiguous()

    return QuantizedWeight("q4", by_row(w.q, 16), by_row(w.d[..., None], 1).float(), by_row(w.m[..., None], 1).float(),
                           w.group, w.shape)


def for_this_cpu(w: QuantizedWeight, amx: bool) -> QuantizedWeight:
    """The layout the engine keeps `w` in: q4 in tile order where the AMX kernel takes it (`amx`: our C
    kernels run, on a CPU with the tiles), else as it is."""
    if w.kind == "q4" and not w.tiles and amx:  # q4: K in 32s
        return pack_tiles(w)
    return w


def rows(w: QuantizedWeight, index: torch.Tensor) -> QuantizedWeight:
    """The weight's output rows reordered (GGUF's q/k head permutation undone on the blocks)."""
    w = unpack_tiles(w)
    pick = lambda t: None if t is None else t[index].contiguous()  # noqa: E731
    return QuantizedWeight(w.kind, pick(w.q), pick(w.d), pick(w.m), w.group, (len(index), w.shape[1]))


def concat(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stacked along the output rows (fused qkv, gate_up)."""
    parts = [unpack_tiles(p) for p in parts]
    first = parts[0]
    if any(p.kind != first.kind or p.group != first.group or p.shape[1] != first.shape[1] for p in parts):
        raise ValueError("fused projections must share one quantization format")
    cat = lambda ts: None if ts[0] is None else torch.cat(ts).contiguous()  # noqa: E731
    return QuantizedWeight(first.kind, cat([p.q for p in parts]), cat([p.d for p in parts]),
                           cat([p.m for p in parts]), first.group, (sum(p.shape[0] for p in parts), first.shape[1]))


def dequantize(w: QuantizedWeight) -> torch.Tensor:
    """The float32 weight [N, K] the quantized one stands for (the reference)."""
    w = unpack_tiles(w)
    n, k = w.shape
    if w.kind == "q4":
        packed = w.q.reshape(n, k // 32, 16)
        q = torch.cat([packed & 0x0F, packed >> 4], dim=-1).float()
        return (q * w.d[..., None] + w.m[..., None]).reshape(n, k)
    q = w.q.reshape(n, k // w.group, w.group).float()
    return (q * w.d[..., None]).reshape(n, k)


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """The float values the int8-activation kernels multiply: x [..., K] in groups of 32, each
    rounded to dx * q with q in -127..127 and dx = max |x| / 127 (llama.cpp's Q8_0)."""
    groups = x.float().reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    d = groups.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(groups * inv) * d).reshape(x.shape)


def reference_matmul(x: torch.Tensor, w: QuantizedWeight, int8_activations: bool = False,
                     dense_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if dense_dtype != torch.float32:  # the dense path's rounding: inputs and output in dense_dtype
        return (x.to(dense_dtype).float() @ dequantize(w).to(dense_dtype).float().T).to(dense_dtype).float()
    return (quantize_activations(x) if int8_activations else x.float()) @ dequantize(w).T


def dequantized(w: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """dequantize(w) in `dtype` (float32 or bfloat16), by the C kernel where it is built."""
    if cpu_kernels.library() is None:
        return dequantize(w).to(dtype)
    out = torch.empty(w.shape, dtype=dtype)
    cpu_kernels.ops.quant_dequantize(_kind(w), w.q, w.d, w.m, w.group, *w.shape, KV_KINDS[dtype], out)
    return out


def amx_matmul(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """x [M, K] float32 or bfloat16 -> [M, N] in x's dtype on AMX tiles (the C library built with AMX):
    the dense path's numbers (x and w rounded to bf16, float32 sums), without its dequantized copy."""
    return _bf16_pairs_matmul(cpu_kernels.ops.quant_matmul_amx, x, w)


def dpbf16_matmul(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """`amx_matmul`'s numbers on AVX512-BF16 dot products (the C library built with AVX512-BF16)."""
    return _bf16_pairs_matmul(cpu_kernels.ops.quant_matmul_dpbf16, x, w)


def _kind(w: QuantizedWeight) -> int:
    """The C kernels' code for the weight's format."""
    if w.tiles:
        return WEIGHT_KINDS["q4_tiles_f16" if w.d.dtype == torch.float16 else "q4_tiles"]
    return WEIGHT_KINDS[w.kind]


def _bf16_pairs_matmul(kernel, x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
    kind = KV_KINDS[x.dtype]
    kernel(_kind(w), x, kind, x.shape[0], w.shape[1], w.q, w.d, w.m, w.group, w.shape[0], kind, out)
    return out


def int8_activations_fit(w: QuantizedWeight) -> bool:
    return w.shape[1] % 32 == 0 and (w.kind == "q4" or w.group % 32 == 0)


def int8_matmul(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """x [M, K] rounded to int8 per group of 32 (llama.cpp's Q8_0) times w in integer dot products -> float32
    (only where the library has them: `CpuCaps.int8_dot`)."""
    x, out = _float_x(x, w)
    if w.kind == "q4":
        status = cpu_kernels.ops.q4_matmul_x8(x, x.shape[0], w.shape[1], w.q, w.d, w.m, w.shape[0], out)
    else:
        status = cpu_kernels.ops.q8_matmul_x8(x, x.shape[0], w.shape[1], w.q, w.d, w.group, w.shape[0], out)
    if status != 0:
        raise RuntimeError(f"{w.kind} int8-activation kernel not built for this CPU (status {status})")
    return out


def float_matmul(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """x [M, K] in float32 (bf16 activations: exact in it) times w, each weight row dequantized once -> float32."""
    x, out = _float_x(x, w)
    if w.kind == "q4":
        cpu_kernels.ops.q4_matmul(x, x.shape[0], w.shape[1], w.q, w.d, w.m, w.shape[0], out)
    else:
        cpu_kernels.ops.q8_matmul(x, x.shape[0], w.shape[1], w.q, w.d, w.group, w.shape[0], out)
    return out


def dense_matmul(x: torch.Tensor, w: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """The weight dequantized in C and oneDNN's GEMM in `dtype` (x, w and the output rounded to it)."""
    return F.linear(x.to(dtype), dequantized(w, dtype))


def _float_x(x: torch.Tensor, w: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.float().contiguous()
    return x, torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)


class QuantPlan:
    """Which kernel multiplies `w` by a call of so many tokens: one table, built once per weight from this
    machine's `TuneTable` and `CpuCaps`; a call looks its token count up and runs that kernel."""

    def __init__(self, w: QuantizedWeight, routes: list[tuple[int, str, Callable]]) -> None:
        self.w = w
        self.starts = [start for start, _, _ in routes]  # ascending; the first is 1
        self.names = [name for _, name, _ in routes]
        self.kernels = [kernel for _, _, kernel in routes]

    def taking_from(self, start: int, name: str, kernel: Callable) -> "QuantPlan":
        """This plan below `start` tokens, `kernel` from there on."""
        kept = [(s, n, k) for s, n, k in zip(self.starts, self.names, self.kernels) if s < start]
        return QuantPlan(self.w, [*kept, (start, name, kernel)])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.w
        flat = x.reshape(-1, w.shape[1])
        kernel = self.kernels[bisect.bisect_right(self.starts, flat.shape[0]) - 1]
        return kernel(flat).to(x.dtype).reshape(*x.shape[:-1], w.shape[0])

    def describe(self) -> str:
        ends = [*(s - 1 for s in self.starts[1:]), None]
        return ", ".join(f"{n} {s}-{'' if e is None else e}" for s, e, n in zip(self.starts, ends, self.names))


def plan(w: QuantizedWeight, tune: TuneTable, caps: CpuCaps, dtype: torch.dtype = torch.float32) -> QuantPlan:
    """`w`'s kernels by token count for activations of `dtype` (float32 or bfloat16): without the C kernels the
    reference; else what `route` says at each of the table's thresholds (the routes only change there)."""
    if not caps.library:
        return QuantPlan(w, [(1, "reference", lambda x: reference_matmul(x, w))])
    routes = []
    for start in _thresholds(tune):
        name = route(w, start, tune, caps)
        if not routes or routes[-1][1] != name:
            routes.append((start, name, name))
    rows = unpack_tiles(w) if w.tiles and {"dpbf16", "int8", "float"} & {n for _, n, _ in routes} else w
    return QuantPlan(w, [(start, name, _kernel(name, w, rows, tune)) for start, name, _ in routes])


def _thresholds(tune: TuneTable) -> list[int]:
    edges = {1, tune.int8_activation_tokens + 1, tune.dense_tokens_bf16, tune.dense_tokens_f32,
             *tune.amx_tokens, *tune.amx_tile_order_tokens, *tune.dpbf16_tokens}
    return sorted(e for e in edges if e >= 1)


def _kernel(name: str, w: QuantizedWeight, rows: QuantizedWeight, tune: TuneTable) -> Callable:
    """`rows`: `w` by rows, for the kernels that cannot read the tile order (a tile-order weight's calls outside
    the tile kernel's range, only where a table narrows it)."""
    dense = tune.torch_dense_dtype
    return {"amx": lambda x: amx_matmul(x, w), "dpbf16": lambda x: dpbf16_matmul(x, rows),
            "int8": lambda x: int8_matmul(x, rows), "float": lambda x: float_matmul(x, rows),
            "dense": lambda x: dense_matmul(x, w, dense)}[name]


def route(w: QuantizedWeight, tokens: int, tune: TuneTable, caps: CpuCaps) -> str:
    """The kernel for a call of `tokens` tokens: on AMX the tile kernel in its range; without AMX, bf16 dot
    products where they measured faster; int8 activations for decode sizes; the float kernel; from the dense
    threshold on (in the GEMM's dtype) a GEMM on the dequantized weight."""
    dense_from = tune.dense_tokens(tune.torch_dense_dtype)
    if w.tiles:  # kept in tile order only on AMX (`for_this_cpu`)
        low, high = tune.amx_tile_order_tokens
        if low <= tokens < high:
            return "amx"
        if tokens >= max(dense_from, high):
            return "dense"
    if int8_activations_fit(w):  # the bf16 kernels' groups are whole 32s too
        if caps.amx and tune.amx_tokens[0] <= tokens < tune.amx_tokens[1]:
            return "amx"
        low, high = tune.dpbf16_tokens
        if not caps.amx and caps.dpbf16 and low <= tokens < high:
            if tune.dpbf16_wins:
                return "dpbf16"
            dense_from = high  # the float kernel: where it ties the dot products, it beats the GEMM
    if tokens <= tune.int8_activation_tokens and caps.int8_dot and int8_activations_fit(w):
        return "int8"
    return "dense" if tokens >= dense_from and tokens > tune.int8_activation_tokens else "float"


def quantized_matmul(x: torch.Tensor, w: QuantizedWeight, tune: TuneTable | None = None,
                     caps: CpuCaps | None = None) -> torch.Tensor:
    """x [..., K] float32 or bfloat16 -> [..., N] in x's dtype, through a plan made for this call (tests and
    benchmarks; the engine makes one plan per weight at load)."""
    caps = CpuCaps.detect() if caps is None else caps
    tune = tune or autotune.resolve(caps.native_bf16, caps.dpbf16, caps.amx, kernel_seconds=kernel_seconds) \
        if caps.library else autotune.DEFAULT
    return plan(w, tune, caps)(x)


def kernel_seconds(tokens: int = 32, size: int = 1024, rounds: int = 4) -> dict[str, float]:
    """The best of `rounds` calls of each mid-size quantized kernel on a q4 weight, taking turns: the probe
    `autotune.resolve` is handed to measure whether bf16 dot products beat the float kernel here."""
    gen = torch.Generator().manual_seed(0)
    w = quantize(torch.randn(size, size, generator=gen), "q4")
    x = torch.randn(tokens, size, generator=gen)
    kernels = {"bf16 dot-product": lambda: dpbf16_matmul(x, w), "float": lambda: float_matmul(x, w)}
    best = {name: float("inf") for name in kernels}
    for _ in range(rounds + 1):
        for name, kernel in kernels.items():
            start = time.perf_counter()
            kernel()
            best[name] = min(best[name], time.perf_counter() - start)
    return best
