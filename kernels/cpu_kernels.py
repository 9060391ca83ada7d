"""CPU kernels in C (`cpu_kernels.c`): paged attention for short query chunks, the
multi-LoRA delta for decode-like batches, and weight-only 4/8-bit matmuls (`quant.py`). Built once per machine with the system C compiler
into the loraplex cache, called through ctypes on float32 tensors (the multi-LoRA delta also on
bfloat16 ones, accumulating in float32).

No compiler, or a failed build: `library()` returns None (logged once) and callers keep the
PyTorch path. `LORAPLEX_CC` names the compiler (default `cc`).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger("loraplex")

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math",
         "-fassociative-math", "-fno-signed-zeros", "-ffp-contract=fast"]
_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False
SGMV_DTYPES = (torch.float32, torch.bfloat16)  # the multi-LoRA kernel's variants
_kv_f16 = False  # whether the built library reads float16 K/V (compiled with F16C)


def library() -> ctypes.CDLL | None:
    global _library, _tried, _kv_f16
    if _tried:  # every kernel call asks: no lock once the build was tried
        return _library
    with _lock:
        if not _tried:
            try:
                _library = _load(_build())
                _kv_f16 = bool(_library.kv_f16_supported())
            except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
                log.warning("C kernels unavailable (%s); using the PyTorch path", exc)
            _tried = True
    return _library


def _cache_dir() -> Path:
    root = os.environ.get("LORAPLEX_CACHE") or Path.home() / ".cache" / "loraplex"
    return Path(root) / "kernels"


def _build() -> Path:
    compiler = os.environ.get("LORAPLEX_CC", "cc")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler {compiler!r} on PATH")
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([compiler, *FLAGS]).encode() + _cpu_flags()).hexdigest()[:16]
    target = _cache_dir() / f"cpu_kernels-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # concurrent builders: last rename wins
        built = Path(tmp) / target.name
        result = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"],
                                capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[:500]}")
        os.replace(built, target)
    return target


def _cpu_flags() -> bytes:
    """-march=native binaries are per CPU: the cache key includes what the CPU offers."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.encode()
    except OSError:
        pass
    return b""


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.paged_attention_f32.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64,
                                        ctypes.c_float, ctypes.c_int, ptr]
    lib.kv_f16_supported.argtypes = []
    lib.kv_f16_supported.restype = ctypes.c_int
    for fn in (lib.sgmv_lora_table_f32, lib.sgmv_lora_table_bf16):
        fn.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, ptr]
    lib.q4_matmul.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, ptr]
    lib.q8_matmul.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, ptr]
    lib.rms_norm_f32.argtypes = [ptr, ptr, i64, i64, ctypes.c_float, ptr]
    for fn in (lib.paged_attention_f32, lib.sgmv_lora_table_f32, lib.sgmv_lora_table_bf16, lib.q4_matmul,
               lib.q8_matmul, lib.rms_norm_f32):
        fn.restype = ctypes.c_int
    return lib


def usable(*tensors: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> bool:
    """CPU tensors of `dtypes`, contiguous (the kernels index raw memory), and a built library."""
    return library() is not None and all(
        t.device.type == "cpu" and t.dtype in dtypes and t.is_contiguous() for t in tensors)


KV_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # the attention kernel's kv_kind


def usable_kv(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """K/V caches the attention kernel reads: float32, bfloat16, or float16 where the CPU
    converts it (F16C)."""
    kinds = (torch.float32, torch.bfloat16, torch.float16) if _f16c() else (torch.float32, torch.bfloat16)
    return usable(k_cache, v_cache, dtypes=kinds) and k_cache.dtype == v_cache.dtype


def _f16c() -> bool:
    return library() is not None and _kv_f16


def paged_attention_c(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                      token_request: torch.Tensor, scale: float) -> torch.Tensor:
    """query [T, Hq, D] -> [T, Hq, D] in its dtype (the math in float32); caches [num_blocks,
    block_size, Hkv, D], float32, bfloat16 or float16; index tensors int64 on the CPU;
    token_request [T] is each query token's request row."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    dtype, query = query.dtype, query.float().contiguous()
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("C paged attention needs contiguous K/V caches")
    tables, seq_lens, query_start_loc, token_request = (
        t.to(torch.int64).contiguous() for t in (block_tables, seq_lens, query_start_loc, token_request))
    out = torch.empty_like(query)
    status = library().paged_attention_f32(
        query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.shape[1],
        seq_lens.data_ptr(), query_start_loc.data_ptr(), token_request.data_ptr(),
        num_tokens, num_heads, num_kv_heads, head_dim, k_cache.shape[1], scale,
        KV_KINDS[k_cache.dtype], out.data_ptr())
    if status != 0:
        raise MemoryError("C paged attention could not allocate its score buffer")
    return out.to(dtype)


def rms_norm_c(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm over the last dimension of a contiguous float32 CPU tensor, in one C call."""
    out = torch.empty_like(x)
    library().rms_norm_f32(x.data_ptr(), weight.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], eps,
                           out.data_ptr())
    return out


def sgmv_lora_table_c(x: torch.Tensor, table, tokens: torch.Tensor, token_slots: torch.Tensor,
                      y: torch.Tensor) -> torch.Tensor:
    """y[t] += scale[s] * (x[t] A[s]^T) Bt[s], in place, for each token t in `tokens` with slot s
    in `token_slots`, reading each slot's weights where `table` (a `sgmv.LoRATable`) points.
    x, y and the weights share one dtype, float32 or bfloat16; accumulation is float32."""
    if not (x.is_contiguous() and y.is_contiguous()):
        raise ValueError("C SGMV needs contiguous inputs")
    kernel = library().sgmv_lora_table_bf16 if x.dtype == torch.bfloat16 else library().sgmv_lora_table_f32
    if tokens.dtype != torch.int64 or token_slots.dtype != torch.int64:
        tokens, token_slots = tokens.to(torch.int64), token_slots.to(torch.int64)
    tokens, token_slots = tokens.contiguous(), token_slots.contiguous()
    status = kernel(x.data_ptr(), table.a_ptrs.ctypes.data, table.b_ptrs.ctypes.data, table.ranks_arr.ctypes.data,
                    table.scales_arr.ctypes.data, tokens.data_ptr(), token_slots.data_ptr(),
                    table.offsets_arr.ctypes.data, len(tokens), x.shape[1], table.num_slices,
                    int(table.ranks_arr.max()), y.data_ptr())
    if status != 0:
        raise MemoryError("C SGMV could not allocate its row buffer")
    return y
