"""How many device kernels a block of code launches (`LaunchCounter`): for the GPU check's launches per decode step
(`benchmarks/gpu_check.py`, an eager step outside graph capture) and for the tests that keep that number bounded
(`tests/kernels/test_launch_count.py`, on the CPU under Triton's interpreter).

What counts:

- every ATen op that reaches a kernel, seen through a `TorchDispatchMode` (below autograd, so `F.linear` is
  seen as the `t` + `mm` it runs): one launch per op that touches a tensor on the counted device type (an
  argument or a result there; `device=None`: any device), host-to-device copies included (`_to_copy`, `copy_`:
  a copy on the stream) and `item()`'s read back. A composite op the mode sees whole (under `inference_mode`,
  as the engine's steps run: `linear`, `reshape`, `to`, `rms_norm`) counts as the ops of its decomposition,
  unless the backend has a kernel of its own for it (as a CUDA build has for `_fused_rms_norm`; the CPU build
  runs it as 6 ops). Not counted: ops that only make a view or read metadata (`VIEW_OPS`: view, `_unsafe_view`,
  `as_strided`, `expand`, `t` / `transpose` / `permute`, `select` / `slice` / `split` / `unbind`, `squeeze` /
  `unsqueeze`, `detach`, `alias`, ...; any op whose schema returns an alias of an argument without writing it),
  allocations (`empty`, `empty_strided`, `empty_like`: nothing runs on the device), size / stride queries. One
  ATen op may launch more than one kernel on CUDA (a reduction in two passes, a GEMM with a split-K reduce): it
  counts 1, so the count is a floor of what the profiler shows;
- every Triton kernel launch (`kernel[grid](...)`), one each, by the kernel's name: the `run` of Triton's
  `JITFunction` (CUDA) and `InterpretedFunction` (`TRITON_INTERPRET=1`) wrapped while a counter is open (Triton's
  `launch_enter_hook` is not called by the interpreter). The ATen ops a Triton launch makes itself (the
  interpreter's copies to and from the host) are not counted.

Counters nest (each counts everything inside it); the Triton wrapper is process-wide while any is open, so a
launch from another thread counts too; the ATen mode is this thread's. Plain: no device sync, nothing timed.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ops that launch nothing: views (and any op whose schema returns an alias of an argument without writing it),
# metadata changed in place, allocations, queries; composite ops (`reshape`, `flatten`, `chunk`, ...) are counted
# as what they decompose into
VIEW_OPS = frozenset({
    "view", "_unsafe_view", "_reshape_alias", "as_strided", "expand", "t", "transpose", "permute", "select", "slice",
    "split", "split_with_sizes", "unbind", "squeeze", "unsqueeze", "diagonal", "detach", "alias", "lift_fresh",
    "view_as_real", "view_as_complex",
    "detach_", "set_", "t_", "transpose_", "squeeze_", "unsqueeze_", "as_strided_", "resize_",
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided",
    "size", "sym_size", "stride", "sym_stride", "sym_numel", "storage_offset", "sym_storage_offset", "is_pinned",
    "is_same_size", "record_stream", "_has_compatible_shallow_copy_type",
})

_lock = threading.Lock()
_open: list["LaunchCounter"] = []  # every open counter, innermost last
_triton_depth = threading.local()  # inside a Triton launch: its own ATen ops are not counted
_saved_runs: dict = {}  # Triton class -> its own `run`, while wrapped


class LaunchCounter:
    """Counts the device kernel launches made inside `with LaunchCounter() as launches:`.

    `device`: the device type whose ops count ("cuda", "cpu"; None: every op); by default the current accelerator's
    when torch sees one, else "cpu". After the block: `aten` and `triton` (the totals), `by_name` (a `Counter` of
    "aten.mm", "mkldnn._linear_pointwise", "triton:_shrink_kernel", ...), `total`; `summary()` says it in one
    line."""

    def __init__(self, device: str | torch.device | None = "default") -> None:
        if device == "default":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device).type if device is not None else None
        self.by_name: Counter[str] = Counter()
        self._mode = _AtenMode(self)

    @property
    def aten(self) -> int:
        """The dispatcher's ops (`aten.`, and other namespaces such as `mkldnn.`)."""
        return sum(n for name, n in self.by_name.items() if not name.startswith("triton:"))

    @property
    def triton(self) -> int:
        return sum(n for name, n in self.by_name.items() if name.startswith("triton:"))

    @property
    def total(self) -> int:
        return sum(self.by_name.values())

    def summary(self, top: int = 8) -> str:
        names = ", ".join(f"{name} x{n}" for name, n in self.by_name.most_common(top))
        return f"{self.total} launches: {self.aten} aten, {self.triton} triton; top: {names}"

    def __enter__(self) -> "LaunchCounter":
        with _lock:
            if not _open:
                _wrap_triton()
            _open.append(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        with _lock:
            _open.remove(self)
            if not _open:
                _unwrap_triton()

    def _count_aten(self, func, args, kwargs, out) -> None:
        if getattr(_triton_depth, "n", 0) or not launches(func):
            return
        if self.device is None or _touches(self.device, (args, kwargs, out)):
            self.by_name[f"{func.namespace}.{func.overloadpacket.__name__}"] += 1


@contextlib.contextmanager
def per_module(counter: LaunchCounter, modules: Sequence[torch.nn.Module]) -> Iterator[list[int]]:
    """The launches `counter` sees inside each module's forward while the block runs (a decode step's decoder
    layers: launches per layer), one number per module in `modules`' order."""
    counts = [0] * len(modules)
    handles = []
    for i, module in enumerate(modules):
        def before(module, args, i=i):
            counts[i] -= counter.total

        def after(module, args, out, i=i):
            counts[i] += counter.total

        handles += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
    try:
        yield counts
    finally:
        for handle in handles:
            handle.remove()


def launches(func) -> bool:
    """Whether an ATen op does work on the device: not a view, an allocation or a metadata read."""
    name = func.overloadpacket.__name__
    if name in VIEW_OPS:
        return False
    returns = func._schema.returns
    # a result that aliases an argument without writing it (`Tensor(a)`, not `Tensor(a!)`) is a view
    return not (returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns))


def _touches(device: str, tree) -> bool:
    leaves, _ = torch.utils._pytree.tree_flatten(tree)
    return any(isinstance(x, torch.Tensor) and x.device.type == device for x in leaves)


class _AtenMode(TorchDispatchMode):
    def __init__(self, counter: LaunchCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _decomposes(func, args, kwargs):
            with self:  # counted as the ops it runs
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        self.counter._count_aten(func, args, kwargs, out)
        return out


def _decomposes(func, args, kwargs) -> bool:
    """Whether the op runs as its composite decomposition on its tensors' device: a CompositeImplicitAutograd op
    without a kernel of its own for that backend. Under `inference_mode` the dispatch mode sees such ops whole
    (`reshape`, `linear`, `to`, `rms_norm`); outside it autograd would have decomposed them already."""
    name = func.name()
    if not torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd"):
        return False
    leaves, _ = torch.utils._pytree.tree_flatten((args, kwargs))
    device = next((x.device.type for x in leaves if isinstance(x, torch.Tensor)), None)
    backend = _BACKEND_KEYS.get(device)
    return backend is None or not torch._C._dispatch_has_kernel_for_dispatch_key(name, backend)


_BACKEND_KEYS = {"cpu": "CPU", "cuda": "CUDA", "meta": "Meta", "xpu": "XPU", "mps": "MPS"}


def _triton_classes() -> list:
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:  # no Triton: only ATen ops count
        return []
    return [JITFunction, InterpretedFunction]


def _wrap_triton() -> None:
    for cls in _triton_classes():
        run = _saved_runs[cls] = cls.run

        def counted(self, *args, grid, warmup, _run=run, **kwargs):
            if not warmup:
                name = f"triton:{getattr(self.fn, '__name__', '?')}"
                for counter in list(_open):
                    counter.by_name[name] += 1
            _triton_depth.n = getattr(_triton_depth, "n", 0) + 1
            try:
                return _run(self, *args, grid=grid, warmup=warmup, **kwargs)
            finally:
                _triton_depth.n -= 1

        cls.run = counted


def _unwrap_triton() -> None:
    for cls, run in _saved_runs.items():
        cls.run = run
    _saved_runs.clear()
