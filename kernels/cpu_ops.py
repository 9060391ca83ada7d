"""Bindings of the C kernels (`kernels/csrc`), generated from one declaration per exported function.

`DECLARATIONS` lists every function the library exports: its arguments in order (a tensor with its allowed
dtypes, whether None may stand for it and the fewest elements it must hold, as an expression over the int
arguments; an int64, an int, a float, or a raw address the caller owns) and what its int result means (a
status: 0, or -1 for an allocation that failed, other codes refused arguments; or a value). From it
`set_signatures` gives the ctypes library its argtypes, and `checked` generates once per function a Python
wrapper on torch tensors that raises, naming the function and the argument, instead of crashing the process:
TypeError for a non-tensor or a wrong dtype (or a wrong argument count), ValueError for a tensor off the CPU,
not contiguous or too small; MemoryError for status -1, RuntimeError for another non-zero status unless the
function declares it returned (the int8-activation kernels' -3: not built for this CPU).

The kind codes the C kernels read (element kinds of x / y / K/V, weight kinds of the quantized kernels) are
declared here once; the build passes them to the compiler (`kind_defines`).
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from typing import Callable

import torch

ELEMENT_KINDS = {"f32": 0, "f16": 1, "bf16": 2, "fp8": 3}  # fp8: float8 e4m3fn
WEIGHT_KINDS = {"q4": 4, "q4_tiles": 5, "q4_tiles_f16": 6, "q8": 8}  # q4 by rows, q4 in AMX tile order, q8
KIND_NAMES = (*ELEMENT_KINDS, *WEIGHT_KINDS)  # the order of the C's `kind_codes`
KIND_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def kind_defines() -> list[str]:
    """The compiler flags that give the C sources the kind codes (isa.h refuses to build without them)."""
    kinds = {**ELEMENT_KINDS, **WEIGHT_KINDS}
    codes = ",".join(f"KIND_{name.upper()}" for name in KIND_NAMES)
    return [f"-DKIND_{name.upper()}={code}" for name, code in kinds.items()] + [f"-DKIND_CODES={{{codes}}}"]


@dataclass(frozen=True)
class Tensor:
    """A pointer argument taken as a torch tensor: CPU, contiguous, one of `dtypes`, at least `min` elements."""
    name: str
    dtypes: tuple[torch.dtype, ...]
    min: str = ""  # an expression over the int arguments; empty: not checked
    nullable: bool = False  # None passes NULL


@dataclass(frozen=True)
class Scalar:
    name: str
    ctype: type  # ctypes.c_int64, c_int or c_float; c_void_p: an address the caller owns (not checked)


def I64(name: str) -> Scalar:
    return Scalar(name, ctypes.c_int64)


def Int(name: str) -> Scalar:
    return Scalar(name, ctypes.c_int)


def Float(name: str) -> Scalar:
    return Scalar(name, ctypes.c_float)


def Addr(name: str) -> Scalar:
    return Scalar(name, ctypes.c_void_p)


@dataclass(frozen=True)
class Function:
    name: str
    args: tuple[Tensor | Scalar, ...]
    value: bool = False  # the result is a value (feature flags, counts), not a status
    returned: tuple[int, ...] = ()  # statuses handed back to the caller instead of raised


F32, F16, BF16, FP8 = torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn
I64_T, U8, I8 = torch.int64, torch.uint8, torch.int8
XY = (F32, BF16)  # x / y of the kernels that take either kind
KV = (F32, F16, BF16, FP8)  # K/V caches
QUANT = (Tensor("q", (U8, I8), "N * K // 2"), Tensor("d", (F32, F16), "N * (K // max(G, 1))"),
         Tensor("m", (F32, F16), "N * (K // max(G, 1))", nullable=True))
LORA = (Addr("a_ptrs"), Addr("b_ptrs"), Addr("ranks"), Addr("scales"), Tensor("tokens", (I64_T,), "num_tokens"),
        Tensor("token_slots", (I64_T,), "num_tokens"), Tensor("token_weights", (F32,), "num_tokens", nullable=True),
        Addr("offsets"), I64("num_tokens"), I64("in_features"),
        I64("num_slices"), I64("max_rank"))


def _sgmv(name: str, xy: torch.dtype) -> Function:
    return Function(name, (Tensor("x", (xy,), "in_features"), *LORA, Tensor("y", (xy,))))


def _q4(name: str, returned: tuple[int, ...] = ()) -> Function:
    return Function(name, (Tensor("x", (F32,), "M * K"), I64("M"), I64("K"), Tensor("q", (U8,), "N * K // 2"),
                           Tensor("d", (F32,), "N * K // 32"), Tensor("m", (F32,), "N * K // 32"), I64("N"),
                           Tensor("out", (F32,), "M * N")), returned=returned)


def _q8(name: str, returned: tuple[int, ...] = ()) -> Function:
    return Function(name, (Tensor("x", (F32,), "M * K"), I64("M"), I64("K"), Tensor("q", (I8,), "N * K"),
                           Tensor("d", (F32,), "N * (K // max(G, 1))"), I64("G"), I64("N"),
                           Tensor("out", (F32,), "M * N")), returned=returned)


def _bf16_pairs(name: str) -> Function:
    return Function(name, (Int("kind"), Tensor("x", XY, "M * K"), Int("x_kind"), I64("M"), I64("K"), *QUANT, I64("G"),
                           I64("N"), Int("y_kind"), Tensor("y", XY, "M * N")))


DECLARATIONS = (
    Function("paged_attention_f32", (
        Tensor("query", XY, "num_tokens * num_heads * head_dim"), Tensor("k_cache", KV), Tensor("v_cache", KV),
        Tensor("block_tables", (I64_T,)), I64("table_width"), Tensor("seq_lens", (I64_T,)),
        Tensor("query_start", (I64_T,)), Tensor("token_request", (I64_T,), "num_tokens"), I64("num_tokens"),
        I64("num_heads"), I64("num_kv_heads"), I64("head_dim"), I64("block_size"), Float("scale"),
        I64("window"), Float("softcap"),  # sliding window (0: none), soft cap of the scores (0: none)
        Int("kv_kind"), Int("q_kind"), Tensor("out", XY, "num_tokens * num_heads * head_dim"))),
    _sgmv("sgmv_lora_table_f32", F32),
    _sgmv("sgmv_lora_table_bf16", BF16),
    _sgmv("sgmv_lora_table_f32_bf16w", F32),
    Function("add_rms_norm", (Tensor("x", XY, "M * K"), Tensor("residual", XY, "M * K", nullable=True),
                              Tensor("w", XY, "K"), I64("M"), I64("K"), Float("eps"), Int("kind"),
                              Tensor("out", XY, "M * K"))),
    Function("rope_write_kv", (Tensor("qkv", XY, "T * (Hq + 2 * Hkv) * D"), Tensor("cos", XY, "T * D"),
                               Tensor("sin", XY, "T * D"), I64("T"), I64("Hq"), I64("Hkv"), I64("D"),
                               Tensor("slots", (I64_T,), "T"), Tensor("k_cache", KV), Tensor("v_cache", KV),
                               Int("cache_kind"), Int("kind"), Tensor("q_out", XY, "T * Hq * D"))),
    Function("silu_mul", (Tensor("gate_up", XY, "T * 2 * I"), I64("T"), I64("I"), Int("kind"),
                          Tensor("out", XY, "T * I"))),
    Function("f32_matmul", (Tensor("x", (F32,), "M * K"), I64("M"), I64("K"), Tensor("w", (F32,), "N * K"), I64("N"),
                            Tensor("out", (F32,), "M * N"))),
    Function("bf16w_matmul", (Tensor("x", (F32,), "M * K"), I64("M"), I64("K"), Tensor("w", (BF16,), "N * K"),
                              I64("N"), Tensor("out", (F32,), "M * N"))),
    Function("bf16_matmul_amx", (Tensor("x", XY, "M * K"), Int("x_kind"), I64("M"), I64("K"),
                                 Tensor("w", (BF16,), "(N + 31) // 32 * 32 * K"), I64("N"), Int("y_kind"),
                                 Tensor("y", XY, "M * N"))),
    _q4("q4_matmul"),
    _q8("q8_matmul"),
    _q4("q4_matmul_x8", returned=(-3,)),
    _q8("q8_matmul_x8", returned=(-3,)),
    _bf16_pairs("quant_matmul_amx"),
    _bf16_pairs("quant_matmul_dpbf16"),
    Function("quant_dequantize", (Int("kind"), *QUANT, I64("G"), I64("N"), I64("K"), Int("out_kind"),
                                  Tensor("out", XY, "N * K"))),
    Function("shm_all_reduce_f32", (Tensor("x", (F32,), "n"), I64("n"), Addr("flags"), Addr("slots"), Int("rank"),
                                    Int("world"), I64("chunk"), Tensor("seq", (I64_T,), "1"))),
    Function("kind_codes", (Tensor("out", (I64_T,), str(len(KIND_NAMES))),), value=True),
    Function("kv_f16_supported", (), value=True),
    Function("x8_supported", (), value=True),
    Function("amx_supported", (), value=True),
    Function("dpbf16_supported", (), value=True),
)


def set_signatures(lib: ctypes.CDLL) -> None:
    """Every declared function's argtypes and restype on the ctypes library (raw pointers: quant.py's calls)."""
    for fn in DECLARATIONS:
        c = getattr(lib, fn.name)
        c.argtypes = [ctypes.c_void_p if isinstance(a, Tensor) else a.ctype for a in fn.args]
        c.restype = ctypes.c_int


class Ops:
    """The checked wrappers as attributes (`ops.q4_matmul(x, M, K, q, d, m, N, out)`), bound at the first
    attribute read through `load` (a library or None); without a library every read raises RuntimeError."""

    def __init__(self, load: Callable[[], ctypes.CDLL | None]) -> None:
        self._load = load

    def __getattr__(self, name: str):  # only until bound: bound wrappers are found in the instance dict
        if name.startswith("_"):
            raise AttributeError(name)
        if self._load() is None:
            raise RuntimeError(f"ops.{name}: the C kernels are not available here (no library could be built)")
        if name not in self.__dict__:
            raise AttributeError(f"no C kernel {name!r} is declared in cpu_ops.DECLARATIONS")
        return self.__dict__[name]

    def bind(self, lib: ctypes.CDLL) -> None:
        for fn in DECLARATIONS:
            setattr(self, fn.name, checked(fn, getattr(lib, fn.name)))


def checked(fn: Function, c_function) -> Callable:
    """`fn`'s wrapper over the ctypes function: one generated function, the checks inlined (a few attribute
    reads per tensor: these run about 120 times a decode step)."""
    scope = {"_c": c_function, "_ArgumentError": ctypes.ArgumentError,
             "_diagnose": lambda *values: _diagnose(fn, values), "_failed": lambda s: _failed(fn, s),
             "_argument": lambda exc: _argument_error(fn, exc), "_returned": frozenset(fn.returned),
             **{f"_dt{i}": a.dtypes for i, a in enumerate(fn.args) if isinstance(a, Tensor)}}
    exec(_source(fn), scope)  # noqa: S102 - code generated from our own declaration, not from input
    wrapper = scope[fn.name]
    wrapper.__doc__ = f"{fn.name}({', '.join(a.name for a in fn.args)}): checked call (cpu_ops.DECLARATIONS)"
    return wrapper


def _source(fn: Function) -> str:
    """The wrapper's code: one test of every tensor argument (the slow path names the culprit), the C call, the
    status."""
    params = ", ".join(a.name for a in fn.args)
    checks = [_check(a, f"_dt{i}") for i, a in enumerate(fn.args) if isinstance(a, Tensor)]
    lines = [f"def {fn.name}({params}):"]
    if checks:
        lines += ["    try:", f"        ok = {' and '.join(checks)}", "    except (AttributeError, TypeError, ZeroDivisionError):",
                  "        ok = False", "    if not ok:", f"        _diagnose({params})"]
    lines += ["    try:", f"        s = _c({', '.join(_pointer(a) for a in fn.args)})",
              "    except _ArgumentError as exc:", "        raise _argument(exc) from None"]
    if fn.value:
        return "\n".join([*lines, "    return s"])
    test = "s and s not in _returned" if fn.returned else "s"
    return "\n".join([*lines, f"    if {test}:", "        _failed(s)", "    return s"])


def _check(a: Tensor, dtypes: str) -> str:
    n = a.name
    test = f"{n}.dtype in {dtypes} and {n}.is_cpu and {n}.is_contiguous()"  # a non-tensor: AttributeError
    if a.min:
        test += f" and {n}.numel() >= {a.min}"
    return f"({n} is None or {test})" if a.nullable else f"({test})"


def _pointer(a: Tensor | Scalar) -> str:
    if not isinstance(a, Tensor):
        return a.name
    return f"(None if {a.name} is None else {a.name}.data_ptr())" if a.nullable else f"{a.name}.data_ptr()"


def _diagnose(fn: Function, values: tuple) -> None:
    """The slow path of a failed check: which argument, and why."""
    bound = dict(zip((a.name for a in fn.args), values))
    for a in fn.args:
        v = bound[a.name]
        if isinstance(a, Scalar):
            ok = (int, float) if a.ctype is ctypes.c_float else int
            if not isinstance(v, ok) or isinstance(v, bool):
                raise TypeError(f"{fn.name}: {a.name} must be {'a number' if ok != int else 'an int'}, "
                                f"not {type(v).__name__}")
    for a in fn.args:
        if isinstance(a, Tensor):
            _diagnose_tensor(fn, a, bound)
    raise TypeError(f"{fn.name}: arguments refused ({', '.join(f'{k}={type(v).__name__}' for k, v in bound.items())})")


def _diagnose_tensor(fn: Function, a: Tensor, bound: dict) -> None:
    t, where = bound[a.name], f"{fn.name}: {a.name}"
    if t is None and a.nullable:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where} must be a torch.Tensor{' or None' if a.nullable else ''}, not {type(t).__name__}")
    if t.dtype not in a.dtypes:
        raise TypeError(f"{where} must be {' or '.join(str(d) for d in a.dtypes)}, not {t.dtype}")
    if not t.is_cpu:
        raise ValueError(f"{where} must be on the CPU, not {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{where} must be contiguous (the kernel indexes raw memory), got strides {t.stride()}")
    if a.min:
        need = eval(a.min, {"max": max}, {k: v for k, v in bound.items() if not isinstance(v, torch.Tensor)})
        if t.numel() < need:
            raise ValueError(f"{where} holds {t.numel()} elements, the sizes passed need {a.min} = {need}")


def _failed(fn: Function, status: int) -> None:
    if status == -1:
        raise MemoryError(f"{fn.name} could not allocate its buffers")
    raise RuntimeError(f"{fn.name} refused its arguments (status {status})")


def _argument_error(fn: Function, exc: ctypes.ArgumentError) -> TypeError:
    """ctypes' "argument 3: ..." with the argument's name."""
    found = re.match(r"argument (\d+): (.*)", str(exc))
    if not found or int(found[1]) > len(fn.args):
        return TypeError(f"{fn.name}: {exc}")
    return TypeError(f"{fn.name}: {fn.args[int(found[1]) - 1].name}: {found[2]}")
