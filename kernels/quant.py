"""Quantized matmul for CPU: float32 or bfloat16 activations times 4- or 8-bit weights.

Formats (`QuantizedWeight`), both grouped along the input dimension K:
- `q4`: groups of 32, asymmetric, w = d * q + m with q in 0..15 (GGUF Q4_1's math and nibble
  order: byte j of a group holds element j low and element j + 16 high, so GGUF blocks are
  repacked by splitting out their scales, the bits kept as they are).
- `q8`: groups of `group` (32 for GGUF Q8_0, K for per-channel int8), symmetric, w = d * q with q
  in -127..127.

`quantized_matmul` picks per call, by its number of tokens: up to `INT8_ACTIVATION_TOKENS`
(decode), x rounded to int8 per group of 32 and integer dot products (`cpu_kernels.c`, as
llama.cpp does); a few more, the C kernel on float32 x (each weight row dequantized once per call
into L1, every token's dot product taken with it); from `DENSE_TOKENS` (prefill), the weight
dequantized in C and oneDNN's GEMM, in bf16 where that measures faster (`dense_dtype`). On a CPU with
AMX, calls of `AMX_TOKENS` go to the tile kernel instead (weight tiles dequantized to bf16 in L1,
multiplied by the tile unit: the dense path's rounding without its dequantized copy); with AVX512-BF16
but no AMX, calls of `DPBF16_TOKENS` to the same math on bf16 dot-product instructions. Where the engine
runs q4 on AMX it keeps it in the tile kernel's order (`for_this_cpu`), which that kernel takes from 1
token to `AMX_TILE_ORDER_TOKENS`. Without the C
kernels: the reference, `x @ dequantize(w).T`; tests compare each path with the reference that
rounds as it does.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from loraplex.kernels import cpu_kernels
from loraplex.kernels.dispatch import backend

log = logging.getLogger("loraplex")

Q4_GROUP = 32
# Calls of at most this many tokens (decode at batch 1-4) multiply int8 activations: there the float
# kernel is bound by dequantizing weights, not reading them; from ~6 tokens its 3-token register
# blocks win (BENCHMARKS.md, "Quantized weights").
INT8_ACTIVATION_TOKENS = 4
# Calls of at least this many tokens (prefill, larger decode batches) dequantize the weight in C and
# run oneDNN's GEMM on it: in bfloat16 where the CPU multiplies it natively and faster (x, w and the
# output rounded to bf16, float32 accumulation: what the bf16 engine does), else in float32 (same
# numbers as the reference). Measured crossovers: BENCHMARKS.md, "Quantized weights".
DENSE_TOKENS = {torch.bfloat16: 32, torch.float32: 96}
# Where the CPU has AMX, calls of [low, high) tokens go to the tile kernel (bf16 rounding, as the dense
# path): below, the int8 kernel is as fast; above, the dense GEMM's reuse wins (BENCHMARKS.md, "q4 in
# bf16 on AMX").
AMX_TOKENS = (3, 192)
# A q4 weight in tile order (`pack_tiles`, what the engine keeps on AMX) takes the tile kernel for calls of
# [low, high) tokens: read as one stream, it is as fast as the int8 kernel by rows at 1 token, faster from
# 2, and faster than dequantizing for a GEMM up to ~330 (BENCHMARKS.md, "q4 in tile order"); the int8
# kernel cannot read it. Outside: the dense GEMM, or (only where a test narrows the range) the weight by
# rows on the other kernels.
AMX_TILE_ORDER_TOKENS = (1, 320)
# Without AMX but with AVX512-BF16 (Zen 4, Cooper Lake, some Xeons), calls of [low, high) tokens go to
# the bf16 dot-product kernel (the tile kernel's numbers) or the float kernel, whichever measured faster
# here (`dpbf16_wins`: on a Xeon without AMX, `vdpbf16ps` is no faster than two float FMAs); from high on,
# the dense GEMM (BENCHMARKS.md, "q4 on AVX512-BF16 without AMX").
DPBF16_TOKENS = (5, 192)
DPBF16_MARGIN = 1.15
DENSE_DTYPE: torch.dtype | None = None  # None: measured (`dense_dtype`)
OUT_KINDS = {dtype: cpu_kernels.KV_KINDS[dtype] for dtype in (torch.float32, torch.bfloat16)}  # x / out kinds


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


def for_this_cpu(w: QuantizedWeight) -> QuantizedWeight:
    """The layout the engine keeps `w` in here: q4 in tile order where the AMX kernel takes it (the
    default kernels), else as it is."""
    if w.kind == "q4" and not w.tiles and backend() == "auto" and cpu_kernels.amx_supported():  # q4: K in 32s
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


def dense_dtype() -> torch.dtype:
    """The dense path's GEMM dtype: `DENSE_DTYPE` if set, else bfloat16 where the CPU multiplies it
    natively and oneDNN's bf16 GEMM measures faster than its float32 one, else float32. Native is not
    enough: on AVX512-BF16 without AMX a prefill-sized float32 GEMM measured 1.4-1.6x faster (BENCHMARKS.md)."""
    return DENSE_DTYPE if DENSE_DTYPE is not None else measured_dense_dtype()


@functools.cache  # once per process: the CPU does not change, and the two differ by far more than noise
def measured_dense_dtype(seconds=None) -> torch.dtype:
    if not cpu_kernels.native_bf16():
        return torch.float32  # emulated bf16 is several times slower: nothing to measure
    times = (seconds or gemm_seconds)((torch.float32, torch.bfloat16))
    choice = min(times, key=times.get)
    log.info("quantized prefill GEMMs in %s (%s)", str(choice).removeprefix("torch."),
             ", ".join(f"{str(d).removeprefix('torch.')} {t * 1e3:.2f} ms" for d, t in times.items()))
    return choice


@functools.cache  # once per process, as `measured_dense_dtype`
def dpbf16_wins(seconds=None) -> bool:
    """Whether the bf16 dot-product kernel beats the float one at mid-size calls on this CPU by
    `DPBF16_MARGIN`: the float kernel's sums are exact, and a near tie must not flip between runs."""
    times = (seconds or kernel_seconds)()
    wins = times["bf16 dot-product"] * DPBF16_MARGIN < times["float"]
    log.info("quantized matmuls of %d-%d tokens on the %s kernel (%s)", DPBF16_TOKENS[0], DPBF16_TOKENS[1] - 1,
             "bf16 dot-product" if wins else "float", ", ".join(f"{k} {t * 1e3:.2f} ms" for k, t in times.items()))
    return wins


def kernel_seconds(tokens: int = 32, size: int = 1024, rounds: int = 4) -> dict[str, float]:
    """The best of `rounds` calls of each mid-size kernel on a q4 weight, taking turns."""
    gen = torch.Generator().manual_seed(0)  # the global RNG is the user's
    w = quantize(torch.randn(size, size, generator=gen), "q4")
    x = torch.randn(tokens, size, generator=gen)
    kernels = {"bf16 dot-product": lambda: dpbf16_matmul(x, w),
               "float": lambda: quantized_matmul(x, w, int8_activations=False)}
    best = {name: float("inf") for name in kernels}
    for _ in range(rounds + 1):
        for name, kernel in kernels.items():
            start = time.perf_counter()
            kernel()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


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


def dequantized(w: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """dequantize(w) in `dtype` (float32 or bfloat16), by the C kernel where it is built."""
    lib = cpu_kernels.library()
    if lib is None:
        return dequantize(w).to(dtype)
    out = torch.empty(w.shape, dtype=dtype)
    status = lib.quant_dequantize(_kind(w), w.q.data_ptr(), w.d.data_ptr(),
                                  None if w.m is None else w.m.data_ptr(), w.group, *w.shape, OUT_KINDS[dtype],
                                  out.data_ptr())
    if status != 0:
        raise RuntimeError(f"{w.kind} weight of shape {w.shape} (group {w.group}) cannot be dequantized")
    return out


def amx_matmul(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """x [M, K] float32 or bfloat16 -> [M, N] in x's dtype on AMX tiles (the C library built with AMX):
    the dense path's numbers (x and w rounded to bf16, float32 sums), without its dequantized copy."""
    return _bf16_pairs_matmul(cpu_kernels.library().quant_matmul_amx, "AMX", x, w)


def dpbf16_matmul(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """`amx_matmul`'s numbers on AVX512-BF16 dot products (the C library built with AVX512-BF16)."""
    return _bf16_pairs_matmul(cpu_kernels.library().quant_matmul_dpbf16, "AVX512-BF16", x, w)


def _kind(w: QuantizedWeight) -> int:
    """The C kernels' code for the weight's format (cpu_kernels.c: 4, 8, Q4_TILES, Q4_TILES_F16)."""
    if w.tiles:
        return 6 if w.d.dtype == torch.float16 else 5
    return 4 if w.kind == "q4" else 8


def _bf16_pairs_matmul(kernel, name: str, x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
    status = kernel(_kind(w), x.data_ptr(), OUT_KINDS[x.dtype], x.shape[0], w.shape[1],
                    w.q.data_ptr(), w.d.data_ptr(), None if w.m is None else w.m.data_ptr(), w.group, w.shape[0],
                    OUT_KINDS[x.dtype], out.data_ptr())
    if status == -1:
        raise MemoryError(f"{w.kind} {name} kernel could not allocate its buffers")
    if status != 0:
        raise RuntimeError(f"{w.kind} {name} kernel refused shape {w.shape} (group {w.group}, status {status})")
    return out


def int8_activations_fit(w: QuantizedWeight) -> bool:
    return w.shape[1] % 32 == 0 and (w.kind == "q4" or w.group % 32 == 0)


def quantized_matmul(x: torch.Tensor, w: QuantizedWeight, int8_activations: bool | None = None) -> torch.Tensor:
    """x [..., K] float32 or bfloat16 -> [..., N] in x's dtype: the C kernels where they are built,
    else the reference; on AMX, calls of `AMX_TOKENS` tokens on the tile kernel (`AMX_TILE_ORDER_TOKENS`
    for a weight in tile order); from `DENSE_TOKENS` tokens on, a GEMM on the dequantized weight.

    `int8_activations` (default: for calls of at most `INT8_ACTIVATION_TOKENS` tokens, where the
    CPU has an integer dot product and the groups are whole 32s) quantizes x per group of 32 and
    multiplies in integers, as llama.cpp does for these formats; False keeps x in float32 (bf16 x
    is exact in it); either, given, also keeps the call off the tile kernel."""
    lib = cpu_kernels.library()
    if lib is None or x.dtype not in OUT_KINDS or x.device.type != "cpu":
        return reference_matmul(x, w).to(x.dtype)
    flat = x.reshape(-1, w.shape[1])
    tokens = flat.shape[0]
    dense = dense_dtype()
    dense_from = DENSE_TOKENS[dense]
    if w.tiles:  # on AMX (`for_this_cpu`)
        if int8_activations is None and cpu_kernels.amx_supported():
            if AMX_TILE_ORDER_TOKENS[0] <= tokens < AMX_TILE_ORDER_TOKENS[1]:
                return amx_matmul(flat, w).reshape(*x.shape[:-1], w.shape[0])
            if tokens >= max(dense_from, AMX_TILE_ORDER_TOKENS[1]):
                y = F.linear(flat.to(dense), dequantized(w, dense)).to(x.dtype)
                return y.reshape(*x.shape[:-1], w.shape[0])
        return quantized_matmul(x, unpack_tiles(w), int8_activations)  # a kernel that reads rows
    if int8_activations is None and int8_activations_fit(w):  # the bf16 kernels' groups are whole 32s too
        if cpu_kernels.amx_supported():
            if AMX_TOKENS[0] <= tokens < AMX_TOKENS[1]:
                return amx_matmul(flat, w).reshape(*x.shape[:-1], w.shape[0])
        elif DPBF16_TOKENS[0] <= tokens < DPBF16_TOKENS[1] and cpu_kernels.dpbf16_supported():
            if dpbf16_wins():
                return dpbf16_matmul(flat, w).reshape(*x.shape[:-1], w.shape[0])
            dense_from = DPBF16_TOKENS[1]  # the float kernel: where it ties the dot products, it beats the GEMM
    if int8_activations is None:
        int8_activations = tokens <= INT8_ACTIVATION_TOKENS
    if not int8_activations and tokens >= dense_from:
        y = F.linear(flat.to(dense), dequantized(w, dense)).to(x.dtype)
        return y.reshape(*x.shape[:-1], w.shape[0])
    flat = flat.float().contiguous()  # the kernels take float32 x (bf16 activations: exact)
    out = torch.empty(flat.shape[0], w.shape[0], dtype=torch.float32)
    args = (flat.data_ptr(), flat.shape[0], w.shape[1], w.q.data_ptr(), w.d.data_ptr())
    status = -3
    if int8_activations and int8_activations_fit(w) and cpu_kernels.int8_dot_supported():
        status = lib.q4_matmul_x8(*args, w.m.data_ptr(), w.shape[0], out.data_ptr()) if w.kind == "q4" else \
            lib.q8_matmul_x8(*args, w.group, w.shape[0], out.data_ptr())
    if status == -3:  # float32 activations: asked for, or the only way these groups / this CPU have
        status = lib.q4_matmul(*args, w.m.data_ptr(), w.shape[0], out.data_ptr()) if w.kind == "q4" else \
            lib.q8_matmul(*args, w.group, w.shape[0], out.data_ptr())
    if status == -1:
        raise MemoryError(f"{w.kind} kernel could not allocate its buffers")
    if status != 0:
        raise RuntimeError(f"{w.kind} kernel refused shape {w.shape} (group {w.group})")
    return out.reshape(*x.shape[:-1], w.shape[0]).to(x.dtype)
