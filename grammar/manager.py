r"""Compiles specs off the engine thread, with a timeout, and builds the step's bitmask.

`submit` returns a future at once and `compile` waits for it; the engine never waits for a
grammar, and a slow compile fails only its own request. With `workers` > 0 (the engine's
setting) compiles run in a pool of worker processes at a lower CPU priority
(grammar/compile_pool.py): one past its timeout is killed, not abandoned, so it neither keeps
burning CPU nor holds a slot. With `workers=0` (tests, offline tools) they run on a thread of
this process and one past its timeout is abandoned. Either way a spec already compiling is
not compiled again: its requests share the one compile (keyed by the spec), and finished
compiles are kept in a bounded cache; at most `max_compiles` distinct specs may be compiling
or waiting for a worker at once. With `cache_dir`, finished compiles are also kept on disk
(grammar/compile_cache.py), keyed like the memory cache (the spec with its namespace) plus the
tokenizer, backend, library versions and sources: a spec missing from memory is looked up there
first, on the manager's own I/O threads, and a compile's result is written there after it is
handed to its requests; so a restarted server does not compile its working set again.

The chain itself (backends, `auto`, refusals that are final, `strict: false` relaxing,
`Compiled.violation`) is grammar/compiler.py. All backends write the same packed bitmask.

Tool calls and specs after a reasoning prefix (grammar/tooling/reasoning.py) are llguidance Lark; the
latter's matchers are wrapped in a `ReasoningGate` (the reasoning budget, and no closing steer
while the model thinks).
"""

from __future__ import annotations

import asyncio
import dataclasses
import concurrent.futures as cf
import logging
import os
import threading
import weakref

import torch

from loraplex.grammar.backend import CompileCache, Grammar, GrammarError, StructuredOutputs
from loraplex.grammar.budget import hint_texts
from loraplex.grammar.compile_cache import DEFAULT_SIZE, GrammarStore
from loraplex.grammar.compile_pool import CompilePool, Job
from loraplex.grammar.compiler import (AUTO_ORDER, BACKENDS, KINDS, MAX_RELAXED, Compiled,  # noqa: F401 (re-exported)
                                       SpecCompiler, json_validator, schema_error)
from loraplex.grammar.tooling.reasoning import CLOSE, ReasoningGate

log = logging.getLogger(__name__)

MAX_CACHED = 256  # finished compiles kept, by spec


class GrammarManager:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], backend: str = "xgrammar",
                 timeout_s: float = 10.0, max_compiles: int = 32, workers: int = 0,
                 cache_dir: str | os.PathLike | None = None, cache_size: int = DEFAULT_SIZE,
                 within_budget: bool = False) -> None:
        self.compiler = SpecCompiler(tokenizer, vocab_size, stop_token_ids, backend)
        self.within_budget = within_budget  # outputs guarded to end valid inside max_tokens (grammar/budget.py)
        self._args = (tokenizer, vocab_size, stop_token_ids)
        self.backend_name = backend
        self.max_compiles = max_compiles
        self.pool = CompilePool((tokenizer, vocab_size, list(stop_token_ids), backend), workers, timeout_s) \
            if workers > 0 else None
        self.timeout_s = timeout_s
        if self.pool is not None:  # an engine dropped without close() (tests) leaves no processes
            weakref.finalize(self, self.pool.close)
        self._lock = threading.Lock()
        self._inflight: dict[str, cf.Future] = {}  # by spec key: one compile however many requests wait
        self._done = CompileCache(MAX_CACHED)
        # the disk cache (None: off), read and written on these threads, never the caller's
        self.store = GrammarStore(cache_dir, cache_size, tokenizer, vocab_size, stop_token_ids, backend) \
            if cache_dir is not None else None
        self._io = cf.ThreadPoolExecutor(4, thread_name_prefix="loraplex-grammar-cache") \
            if self.store is not None else None
        self._io_jobs: set[cf.Future] = set()
        self._warming: threading.Thread | None = None
        self.token_texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
        self.closing_tokens = _closing_tokens(self.token_texts, stop_token_ids, vocab_size)
        self._closers: dict[torch.device, torch.Tensor] = {}
        self.close_ids = tokenizer.encode(CLOSE, add_special_tokens=False)  # what a reasoning budget forces

    @property
    def timeout_s(self) -> float:
        return self._timeout_s

    @timeout_s.setter
    def timeout_s(self, seconds: float) -> None:  # the pool's jobs from now on too
        self._timeout_s = seconds
        if self.pool is not None:
            self.pool.timeout_s = seconds

    def _get(self, name: str):
        return self.compiler.get(name)

    def order(self, spec: StructuredOutputs) -> tuple[str, ...]:
        return self.compiler.order(spec)

    def _compile(self, spec: StructuredOutputs, order: tuple[str, ...] | None = None) -> Compiled:
        return self.compiler.compile(spec, order)

    def compile(self, spec: StructuredOutputs) -> Compiled:
        """The compiled spec; GrammarError naming the problem otherwise."""
        future = self.submit(spec)
        if self.pool is not None:  # the pool ends every job: by its answer, its timeout or its death
            return future.result()
        try:
            return future.result(timeout=self.timeout_s)
        except cf.TimeoutError:
            raise GrammarError(f"{spec.kind} took longer than {self.timeout_s:g}s to compile") from None

    async def compiled(self, spec: StructuredOutputs, namespace: str = "") -> Compiled:
        """`compile` awaited on the caller's event loop: a slow compile holds no thread of the loop's pool
        (a caller that leaves cancels only its own wait). `namespace`: whose cache (a tenant's: another's
        compiles are neither reused nor waited for, so their timing tells nothing)."""
        waiter = asyncio.wrap_future(self.submit(dataclasses.replace(spec, namespace=namespace)))
        if self.pool is not None:
            return await waiter
        try:
            return await asyncio.wait_for(waiter, self.timeout_s)
        except TimeoutError:
            raise GrammarError(f"{spec.kind} took longer than {self.timeout_s:g}s to compile") from None

    def submit(self, spec: StructuredOutputs) -> cf.Future:
        """A future of the compiled spec, at once: a finished one from the cache, the one of the
        same spec's compile in flight, or a new compile's (each within the spec's namespace)."""
        key, mine = spec.key, cf.Future()  # the caller's own: cancelling it leaves the others waiting
        with self._lock:
            cached = self._done.peek(key)
            if cached is not None:
                mine.set_result(cached)
                return mine
            future = self._inflight.get(key)
            new = future is None
            if new:
                if len(self._inflight) >= self.max_compiles:
                    raise GrammarError(f"{self.max_compiles} grammar compiles are already running or waiting "
                                       f"(slow specs); retry later")
                future = self._inflight[key] = cf.Future()
        future.add_done_callback(lambda shared: _copy(shared, mine))
        if not new:
            return mine
        if self._io is not None:
            try:
                self._on_io(self._load_or_compile, spec, future)
                return mine
            except RuntimeError:  # closed: compiled as without a disk cache (the pool says it is shut down)
                pass
        self._dispatch(spec, future)
        return mine

    def _dispatch(self, spec: StructuredOutputs, future: cf.Future) -> None:
        key = spec.key
        done = lambda result, error: self._finish(key, future, result, error, spec)  # noqa: E731
        if self.pool is not None:
            try:
                self.pool.submit(Job(spec, done))
            except GrammarError as exc:
                done(None, exc)
        else:
            threading.Thread(target=self._compile_here, args=(spec, done), name="loraplex-grammar",
                             daemon=True).start()

    def _load_or_compile(self, spec: StructuredOutputs, future: cf.Future) -> None:
        """On an I/O thread: the spec's entry on disk, restored, else a compile as without the disk cache."""
        try:
            compiled = self.store.load(spec, self.compiler)
        except Exception as exc:  # an unusable folder: compiled as without it
            log.warning("grammar cache: reading failed: %s: %s", type(exc).__name__, exc)
            compiled = None
        if compiled is None:
            self._dispatch(spec, future)
        else:
            self._finish(spec.key, future, compiled, None, None)

    def _compile_here(self, spec: StructuredOutputs, done) -> None:
        try:
            result, error = self.compiler.compile(spec), None
        except BaseException as exc:  # handed to the waiters
            result, error = None, exc
        done(result, error)

    def _finish(self, key: str, future: cf.Future, result: Compiled | None, error: BaseException | None,
                spec: StructuredOutputs | None) -> None:
        """A worker's `Compiled` gets its grammar back (grammar/compile_pool.py), is cached, and
        completes the future every waiting request holds; then a fresh compile (`spec` given: not
        one read from disk) is written to the disk cache."""
        exported = None
        if error is None and self.pool is not None and spec is not None:
            exported = result.grammar
            try:
                result.grammar = self.compiler.get(result.backend).restore(result.spec, result.grammar)
            except BaseException as exc:
                error = exc
        if error is None:  # planned here, off the engine's thread and the event loop
            self.shortest(result)
        save = None
        if error is None and spec is not None and self._io is not None:
            try:
                save = self._io.submit(self._save, spec, result, exported, self.pool is not None)
            except RuntimeError:  # closed meanwhile: not kept
                pass
        with self._lock:  # the write is pending before the compile is no longer in flight (flush sees one)
            self._inflight.pop(key, None)
            if save is not None:
                self._io_jobs.add(save)
            if error is None:
                self._done.put(key, result)
        if save is not None:
            save.add_done_callback(self._io_done)
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    def _save(self, spec: StructuredOutputs, compiled: Compiled, exported, from_worker: bool) -> None:
        try:
            if not from_worker:  # compiled here: exported now, off the waiters' path
                exported = self.compiler.get(compiled.backend).export(compiled.grammar)
            self.store.save(spec, compiled, exported)
        except Exception:  # a full disk, an unwritable folder: served from memory, not kept
            log.warning("grammar cache: writing failed", exc_info=True)

    def _on_io(self, fn, *args) -> None:
        """Run `fn` on an I/O thread; RuntimeError once closed."""
        job = self._io.submit(fn, *args)
        with self._lock:
            self._io_jobs.add(job)
        job.add_done_callback(self._io_done)

    def _io_done(self, job: cf.Future) -> None:
        with self._lock:
            self._io_jobs.discard(job)

    def flush(self) -> None:
        """Wait until the warm-up and the disk cache's reads and writes (those they lead to too) are done (tests,
        benchmarks)."""
        if self._warming is not None:
            self._warming.join()
        while True:
            with self._lock:
                jobs = list(self._io_jobs) + list(self._inflight.values())
            if not jobs:
                return
            cf.wait(jobs)

    def warm_up(self) -> None:
        """Start the compile workers now (none without a pool)."""
        if self.pool is not None:
            self.pool.warm_up()
        if self._warming is None:
            self._warming = threading.Thread(target=self._warm_here, name="loraplex-grammar-warm", daemon=True)
            self._warming.start()

    def _warm_here(self) -> None:
        """In the background, what the first structured request would otherwise wait for: the disk cache's key
        (the tokenizer's hash), this process's first backend (a worker's result is restored with it), and
        llguidance's torch module (its first bitmask fill imports it: over a second, on the engine's step)."""
        if self.store is not None:
            self.store.fingerprint()
        first = self.compiler.order(StructuredOutputs(json_object=True))[0]
        try:
            self.compiler.get(first)
        except GrammarError:  # this backend cannot serve the tokenizer: each compile says so
            return
        if first == "llguidance":
            try:
                import llguidance.torch  # noqa: F401
            except ImportError:  # no torch here: the fill says so when it comes
                pass

    @property
    def warm(self) -> bool:
        return self.pool is None or self.pool.warm

    def close(self) -> None:
        """Stop the compile workers (the server's shutdown; also run at exit)."""
        if self.pool is not None:
            self.pool.close()
        if self._io is not None:  # the writes already queued finish
            self._io.shutdown(wait=True)

    def shortest(self, compiled: Compiled) -> int | None:
        """The tokens the shortest answer `compiled` allows takes, as planned (grammar/budget.py): an upper bound,
        exact in the usual cases; None where its outputs are not guarded (the setting off, another backend than
        llguidance, a reasoning first) or no plan was found."""
        if not self.within_budget:
            return None
        if compiled.budget_plan is None:  # planned once (read back with a compile from the disk cache)
            compiled.budget_plan = self._plan(compiled) or False
        return len(compiled.budget_plan[0]) if compiled.budget_plan else None

    def _plan(self, compiled: Compiled) -> tuple | None:
        spec = compiled.spec
        if compiled.backend != "llguidance" or spec.reasoning is not None:
            return None
        try:
            backend = self._get("llguidance")
            planner = backend.planner  # markers (`<tool_call>`, ...) written as one token each are hints too
            hints = planner.hints(hint_texts(spec)) + tuple((t,) for t in backend.markers.special_ids())
            start = planner.plan(compiled.grammar, hints)
        except Exception:  # a bug here must not fail the request: its output is only not guarded
            log.warning("grammar budget: planning failed", exc_info=True)
            return None
        return (start, hints) if start is not None else None

    def new_grammar(self, compiled: Compiled) -> Grammar:
        spec = compiled.spec
        json_like = spec.kind in ("json", "json_object") and spec.reasoning is None
        guarded = {"plan": compiled.budget_plan} if self.shortest(compiled) is not None else {}  # llguidance only
        grammar = self._get(compiled.backend).new_grammar(compiled.grammar, json_like=json_like, **guarded)
        if spec.reasoning is not None:
            grammar = ReasoningGate(grammar, spec.reasoning, self.close_ids, self.token_texts)
        return grammar

    def apply(self, logits: torch.Tensor, grammars: list[Grammar | None], closing: list[bool] | None = None) -> None:
        """Mask each constrained row of `logits` in place to the tokens its grammar allows; a
        `closing` row further to its closing tokens, when the grammar allows any (a subset of
        what it allows: sound)."""
        rows = [i for i, g in enumerate(grammars) if g is not None]
        if not rows:
            return
        vocab_size = self._args[1]
        # filled on the host by the backends, applied where the logits are
        bitmask = torch.full((logits.shape[0], -(-vocab_size // 32)), -1, dtype=torch.int32, device="cpu")
        by_kind: dict[type, list[tuple[Grammar, int]]] = {}
        for i in rows:  # every backend writes the same packed rows: bit k of word j allows token 32*j + k
            by_kind.setdefault(type(grammars[i]), []).append((grammars[i], i))
        for kind, items in by_kind.items():
            if hasattr(kind, "fill_many") and len(items) > 1:  # a backend that fills rows in parallel
                kind.fill_many(items, bitmask)
            else:
                for grammar, i in items:
                    grammar.fill_bitmask(bitmask, i)
        if logits.device.type == "cpu":
            import xgrammar as xgr  # its CPU kernel; a GPU machine may lack the package

            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size, indices=rows)
        else:  # plain tensor ops on the device: no kernel build, no host read
            apply_bitmask(logits, _on(bitmask, logits.device), rows, vocab_size)
        # a reasoning (a ReasoningGate that is `thinking`) is free text: never steered to JSON closers
        steer = [i for i in rows if closing is not None and closing[i] and not getattr(grammars[i], "thinking", False)]
        if steer:
            self._steer_to_closing(logits, steer)

    def _steer_to_closing(self, logits: torch.Tensor, rows: list[int]) -> None:
        """Rows whose grammar allows a closing token keep only those (no host read: where)."""
        closers = self._closers.get(logits.device)
        if closers is None:  # once per device (the tokenizer's ids are all inside the vocab)
            closers = self._closers[logits.device] = self.closing_tokens.to(logits.device)
        index = _on(torch.tensor(rows, dtype=torch.long, device="cpu"), logits.device)
        masked = logits[index]
        kept = masked[:, closers]
        steered = torch.full_like(masked, float("-inf"))
        steered[:, closers] = kept
        logits[index] = torch.where(torch.isfinite(kept).any(dim=1, keepdim=True), steered, masked)


def _copy(shared: cf.Future, mine: cf.Future) -> None:
    if mine.set_running_or_notify_cancel():  # False: its caller stopped waiting
        if shared.exception() is None:
            mine.set_result(shared.result())
        else:
            mine.set_exception(shared.exception())


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab_size: int) -> None:
    """What `xgr.apply_token_bitmask_inplace` does: -inf where bit k of word j (token 32*j + k)
    is 0, in the listed rows and the first `vocab_size` columns."""
    index = _on(torch.tensor(rows, dtype=torch.long, device="cpu"), logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask[index][:, :, None] >> shifts) & 1).flatten(1).bool()[:, :vocab_size]
    logits[index, :vocab_size] = logits[index, :vocab_size].masked_fill(~allowed, float("-inf"))


def _on(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on the logits' device (through pinned memory, not waiting, on CUDA)."""
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host


def _closing_tokens(texts: list[str], stop_token_ids: list[int], vocab_size: int) -> torch.Tensor:
    """Tokens made only of JSON closers (`"`, `]`, `}`), and the stop tokens."""
    ids = [i for i, text in enumerate(texts) if text.strip() and set(text.strip()) <= set('"]}')]
    return torch.tensor(sorted(i for i in set(ids) | set(stop_token_ids) if i < vocab_size), dtype=torch.long,
                        device="cpu")
