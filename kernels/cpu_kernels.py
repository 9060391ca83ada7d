"""CPU kernels in C (`csrc/`, one file per op family over the shared `isa.h`): paged attention for short
query chunks, the multi-LoRA delta for decode-like batches, weight-only 4/8-bit matmuls (`quant.py`), and a
layer's small ops fused (residual add + RMSNorm, RoPE + KV write, SiLU * up). Built once per machine with the
system C compiler into the loraplex cache (the files compiled two at a time, linked into one library), called
through the checked wrappers `ops` (`cpu_ops.py`: generated from one declaration, misuse raises) on float32
tensors (attention, the multi-LoRA delta and the fused layer ops also on bfloat16 ones, with float32 math).

No compiler, or a failed build: `library()` returns None (logged once), `ops` raises, and callers keep the
PyTorch path. `LORAPLEX_CC` names the compiler (default `cc`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplex.kernels import cpu_ops

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(CSRC / name for name in ("lora.c", "layer_ops.c", "attention.c", "quant.c", "dense.c", "kinds.c",
                                         "shm_reduce.c"))
HEADERS = (CSRC / "isa.h", CSRC / "tiles.h")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-fno-math-errno", "-fno-trapping-math",
         "-fassociative-math", "-fno-signed-zeros", "-ffp-contract=fast"]
LINK_FLAGS = ["-shared", "-fopenmp"]
JOBS = 2  # compilers at once (SOURCES go slowest to compile first, so the two finish close together)
_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False
ops = cpu_ops.Ops(lambda: library())  # the checked wrappers, e.g. ops.q4_matmul(x, M, K, q, d, m, N, out)
SGMV_DTYPES = (torch.float32, torch.bfloat16)  # x / y of the multi-LoRA kernel
SGMV_KINDS = {(torch.float32, torch.float32): "sgmv_lora_table_f32", (torch.bfloat16, torch.bfloat16):
              "sgmv_lora_table_bf16", (torch.float32, torch.bfloat16): "sgmv_lora_table_f32_bf16w"}  # (x, weights)
KV_KINDS = {cpu_ops.KIND_DTYPES[name]: code for name, code in cpu_ops.ELEMENT_KINDS.items()}  # the kernels' kv_kind
WEIGHT_KINDS = dict(cpu_ops.WEIGHT_KINDS)  # the quantized kernels' weight kind: q4, q4_tiles, q4_tiles_f16, q8
_kv_f16 = False  # whether the built library reads float16 K/V (compiled with F16C)
_x8 = False  # whether it has an integer dot product for int8 activations (AVX2 and up)
_amx = False  # whether it was built with AMX and the OS lets this process use the tiles
_dpbf16 = False  # whether it was built with AVX512-BF16 dot products


def library() -> ctypes.CDLL | None:
    """The ctypes library with every declared function's argtypes set (None without one); built on first use."""
    global _library, _tried
    if _tried:  # every kernel call asks: no lock once the build was tried
        return _library
    with _lock:
        if not _tried:
            try:
                _library = _load(_build())
            except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
                log.warning("C kernels unavailable (%s); using the PyTorch path", exc)
            _tried = True
    return _library


def _load(path: Path) -> ctypes.CDLL:
    global _kv_f16, _x8, _amx, _dpbf16
    lib = ctypes.CDLL(str(path))
    cpu_ops.set_signatures(lib)
    ops.bind(lib)
    _kv_f16, _x8 = bool(ops.kv_f16_supported()), bool(ops.x8_supported())
    _amx, _dpbf16 = bool(ops.amx_supported()), bool(ops.dpbf16_supported())
    return lib


def source_digest() -> bytes:
    """sha256 of every C source and header (names and contents): what a build or a measurement depends on."""
    digest = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.digest()


def _cache_dir() -> Path:
    root = os.environ.get("LORAPLEX_CACHE") or Path.home() / ".cache" / "loraplex"
    return Path(root) / "kernels"


def _cache_key(compiler: str, flags: list[str]) -> str:
    """-march=native binaries are per CPU: the key has the sources, the flags, the compiler and the CPU's flags."""
    build = " ".join([compiler, *flags, "|", *LINK_FLAGS]).encode()
    return hashlib.sha256(source_digest() + build + _cpu_flags()).hexdigest()[:16]


def _build() -> Path:
    compiler = os.environ.get("LORAPLEX_CC", "cc")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler {compiler!r} on PATH")
    flags = [*FLAGS, *cpu_ops.kind_defines()]
    target = _cache_dir() / f"cpu_kernels-{_cache_key(compiler, flags)}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # concurrent builders: last rename wins
        objects = [Path(tmp) / f"{source.stem}.o" for source in SOURCES]
        with ThreadPoolExecutor(JOBS) as pool:  # each compiler is its own process: threads just wait on them
            list(pool.map(lambda so: _run([compiler, *flags, "-c", str(so[0]), "-o", str(so[1])]),
                          zip(SOURCES, objects)))
        built = Path(tmp) / target.name
        _run([compiler, *LINK_FLAGS, *map(str, objects), "-o", str(built), "-lm"])
        os.replace(built, target)
    log.info("built the C kernels into %s", target)
    return target


def _run(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise RuntimeError(f"{command[0]} failed: {result.stderr.strip()[:500]}")


def _cpu_flags() -> bytes:
    """What the CPU offers (/proc/cpuinfo's flags line)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.encode()
    except OSError:
        pass
    return b""


@functools.cache  # asked per quantized matmul; the CPU does not change
def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX); elsewhere it is emulated."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def usable(*tensors: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> bool:
    """CPU tensors of `dtypes`, contiguous (the kernels index raw memory), and a built library."""
    return library() is not None and all(
        t.device.type == "cpu" and t.dtype in dtypes and t.is_contiguous() for t in tensors)


def usable_kv(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """K/V caches the attention kernel reads: float32, bfloat16, float8 e4m3, or float16 where the
    CPU converts it (F16C)."""
    kinds = (torch.float32, torch.bfloat16, torch.float8_e4m3fn) + ((torch.float16,) if _f16c() else ())
    return usable(k_cache, v_cache, dtypes=kinds) and k_cache.dtype == v_cache.dtype


def int8_dot_supported() -> bool:
    """Whether the quantized matmuls can take int8 activations on this CPU (else float32 ones)."""
    return library() is not None and _x8


def amx_supported() -> bool:
    """Whether the quantized matmuls can run on AMX tiles here (built for a CPU with AMX-BF16,
    and the OS granted this process the tile state)."""
    return library() is not None and _amx


def dpbf16_supported() -> bool:
    """Whether the quantized matmuls can run on AVX512-BF16 dot products here (the library built for it)."""
    return library() is not None and _dpbf16


def pack_bf16_amx(weight: torch.Tensor) -> torch.Tensor:
    """A weight [N, K] (K a multiple of 32) in `bf16_matmul_amx`'s layout: its rows padded to 32 with zeros, then
    per 16 rows and group of 32 k one AMX B tile, [16 pairs of k][16 rows][2] in bfloat16."""
    n, k = weight.shape
    if k % 32:
        raise ValueError(f"the AMX bf16 kernel needs the input dimension to be a multiple of 32, got {k}")
    padded = torch.zeros((n + 31) // 32 * 32, k, dtype=torch.bfloat16)
    padded[:n] = weight
    return padded.view(-1, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


def unpack_bf16_amx(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """`pack_bf16_amx`'s inverse: the weight [N, K]."""
    blocks, groups = packed.shape[:2]
    pairs = packed.view(torch.int32).view(blocks, groups, 16, 16)  # a pair as one 4-byte element: a faster copy
    return pairs.permute(0, 3, 1, 2).reshape(blocks * 16, groups * 16)[:out_features].contiguous().view(torch.bfloat16)


def rows_bf16_amx(packed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` of the weight `pack_bf16_amx` packed, [len(index), K]: a tied embedding table read from the
    LM head's tiles."""
    pairs = packed.view(torch.int32)[index // 16, :, :, index % 16]  # [T, K / 32, 16]: a row's pairs in k order
    return pairs.reshape(len(index), -1).view(torch.bfloat16)


def bf16_matmul_amx_c(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [M, K] (float32 or bfloat16) times the weight `pack_bf16_amx` packed -> [M, N] in x's dtype, on AMX tiles:
    x and the weight in bf16, float32 sums (the numbers of oneDNN's bf16 linear, summed in another order)."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the AMX bf16 kernel takes float32 or bfloat16 x, not {x.dtype}")
    x = x.contiguous()
    out = torch.empty(x.shape[0], out_features, dtype=x.dtype)
    kind = KV_KINDS[x.dtype]
    ops.bf16_matmul_amx(x, kind, x.shape[0], x.shape[1], packed, out_features, kind, out)  # -1: MemoryError
    return out


def f32_matmul_c(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] times a plain float32 weight [N, K] (K a multiple of 8, both contiguous) -> [..., N]: the weight's
    rows streamed once, dotted with every token (meant for decode-sized calls)."""
    rows, k = weight.shape
    tokens = x.numel() // k
    out = x.new_empty(tokens, rows)  # 2-D: cheaper than torch.empty(shape tuple)
    ops.f32_matmul(x, tokens, k, weight, rows, out)  # K not a multiple of 8: RuntimeError ("refused", status -2)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], rows)


def bf16w_matmul_c(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float32 x [..., K] times a bfloat16 weight [N, K] (K a multiple of 8, both contiguous) -> float32 [..., N],
    in float32 math: every token's sums in the same order whatever the call's token count."""
    rows, k = weight.shape
    tokens = x.numel() // k
    out = x.new_empty(tokens, rows)
    ops.bf16w_matmul(x, tokens, k, weight, rows, out)  # K not a multiple of 8: RuntimeError ("refused", status -2)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], rows)


def _f16c() -> bool:
    return library() is not None and _kv_f16


@dataclass(frozen=True)
class CpuCaps:
    """What this CPU and our built C library can do, read once when an engine resolves its config."""

    library: bool = False  # the C kernels were built
    native_bf16: bool = False  # AVX512-BF16 or AMX: bf16 matmuls not emulated
    amx: bool = False  # the library has the AMX tile kernels and the OS grants the tiles
    dpbf16: bool = False  # the library has the AVX512-BF16 dot-product kernels
    int8_dot: bool = False  # the library has integer dot products for int8 activations
    f16c: bool = False  # the library converts float16 K/V

    @staticmethod
    def detect() -> "CpuCaps":
        built = library() is not None
        return CpuCaps(built, native_bf16(), built and amx_supported(), built and dpbf16_supported(),
                       built and int8_dot_supported(), built and _f16c())


def paged_attention_c(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                      token_request: torch.Tensor, scale: float, sliding_window: int | None = None,
                      softcap: float | None = None) -> torch.Tensor:
    """query [T, Hq, D] -> [T, Hq, D] in its dtype (the math in float32); caches [num_blocks,
    block_size, Hkv, D], float32, bfloat16 or float16; index tensors int64 on the CPU;
    token_request [T] is each query token's request row. `sliding_window`: a query sees only the last
    that many positions (blocks before them are never read); `softcap`: scores capped as cap * tanh(s / cap)."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    dtype = query.dtype
    query = (query if dtype == torch.bfloat16 else query.float()).contiguous()  # bf16 read and written in place
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("C paged attention needs contiguous K/V caches")
    tables, seq_lens, query_start_loc, token_request = (
        t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()
        for t in (block_tables, seq_lens, query_start_loc, token_request))
    out = torch.empty_like(query)
    ops.paged_attention_f32(query, k_cache, v_cache, tables, tables.shape[1], seq_lens, query_start_loc,
                            token_request, num_tokens, num_heads, num_kv_heads, head_dim, k_cache.shape[1], scale,
                            sliding_window or 0, softcap or 0.0, KV_KINDS[k_cache.dtype], KV_KINDS[query.dtype], out)
    return out.to(dtype)


LAYER_DTYPES = (torch.float32, torch.bfloat16)  # the fused per-layer kernels' kinds


def add_rms_norm_c(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dimension of a contiguous CPU tensor (float32 or bfloat16, rounded
    as the PyTorch ops round), in one C call. With `residual`: residual += x in place first and
    the norm is of that sum."""
    out = torch.empty_like(x)
    ops.add_rms_norm(x, residual, weight, x.numel() // x.shape[-1], x.shape[-1], eps, KV_KINDS[x.dtype], out)
    return out


def rope_write_kv_c(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                    slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """The fused qkv rows [T, (Hq + 2 Hkv) D] -> rotated q [T, Hq, D]; rotated k and v written
    into the caches [blocks, block_size, Hkv, D] at slot_mapping (-1: skipped). cos, sin [T, D]
    in qkv's dtype."""
    num_tokens, head_dim = qkv.shape[0], cos.shape[-1]
    q = qkv.new_empty(num_tokens, num_heads, head_dim)
    slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.to(torch.int64)
    ops.rope_write_kv(qkv, cos, sin, num_tokens, num_heads, num_kv_heads, head_dim, slots.contiguous(), k_cache,
                      v_cache, KV_KINDS[k_cache.dtype], KV_KINDS[qkv.dtype], q)
    return q


def usable_rope_kv(qkv: torch.Tensor, cos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """The model's kind in the caches, float16 caches under a float32 model where F16C converts, or
    float8 e4m3 caches under either."""
    same = k_cache.dtype in (qkv.dtype, torch.float8_e4m3fn) or \
        (qkv.dtype == torch.float32 and k_cache.dtype == torch.float16 and _f16c())
    return (same and k_cache.dtype == v_cache.dtype and cos.dtype == qkv.dtype
            and usable(qkv, cos, dtypes=LAYER_DTYPES) and usable_kv(k_cache, v_cache))


def silu_mul_c(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] -> silu(gate) * up [..., I] in one C call (float32 or bfloat16)."""
    inter = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], inter)
    ops.silu_mul(gate_up, gate_up.numel() // gate_up.shape[-1], inter, KV_KINDS[gate_up.dtype], out)
    return out


def sgmv_lora_table_c(x: torch.Tensor, table, tokens: torch.Tensor, token_slots: torch.Tensor,
                      y: torch.Tensor, token_weights: torch.Tensor | None = None) -> torch.Tensor:
    """y[t] += w[n] * scale[s] * (x[t] A[s]^T) Bt[s], in place, for each token t = tokens[n] with slot s
    in `token_slots`, reading each slot's weights where `table` (a `sgmv.LoRATable`) points; `token_weights`
    [n] float32 (an adapter mix's weights), None: 1.
    x and y share one dtype, float32 or bfloat16, and the weights x's or bfloat16 under float32
    (`SGMV_KINDS`); accumulation is float32."""
    if not (x.is_contiguous() and y.is_contiguous()):
        raise ValueError("C SGMV needs contiguous inputs")
    kernel = getattr(ops, SGMV_KINDS[(x.dtype, table.dtype)])
    if tokens.dtype != torch.int64 or token_slots.dtype != torch.int64:
        tokens, token_slots = tokens.to(torch.int64), token_slots.to(torch.int64)
    tokens, token_slots = tokens.contiguous(), token_slots.contiguous()
    a_ptrs, b_ptrs, ranks, scales, offsets = table.c_arrays
    kernel(x, a_ptrs, b_ptrs, ranks, scales, tokens, token_slots, token_weights, offsets, len(tokens), x.shape[1],
           table.num_slices, table.max_rank, y)  # -1 (its row buffer not allocated): MemoryError
    return y
