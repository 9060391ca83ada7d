r"""Compiles specs off the engine thread, with a timeout, and builds the step's bitmask.

`compile` waits in the caller's thread for a compile running on a thread of its own (so the
engine never waits for a grammar, and a slow compile fails only its own request). A compile
past its timeout is abandoned, not joined: it finishes in the background without holding up
the next spec (a shared pool would stay wedged by it), and at most `max_compiles` may run at
once, abandoned ones included, so slow specs cannot pile up threads. Each backend keeps
compiled grammars in a bounded cache keyed by the spec.

Backends: "xgrammar" (default), "outlines", or "auto": xgrammar first; a spec xgrammar cannot
compile (a regex with Unicode classes like `\p{Lu}` or inline flags like `(?i)`) goes to
outlines when outlines can. A schema keyword xgrammar would not enforce stays refused under
auto: outlines enforces none that xgrammar does not. Both write the same packed bitmask.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading

import torch

from loraplex.grammar.backend import Grammar, GrammarBackend, GrammarError, StructuredOutputs
from loraplex.grammar.json_schema import UnsupportedKeywordError

BACKENDS = ("xgrammar", "outlines", "auto")


class GrammarManager:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], backend: str = "xgrammar",
                 timeout_s: float = 10.0, max_compiles: int = 8) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"grammar_backend must be one of {BACKENDS}, got {backend!r}")
        self._args = (tokenizer, vocab_size, stop_token_ids)
        self.backend_name = backend
        self.timeout_s = timeout_s
        self._backends: dict[str, GrammarBackend] = {}
        self._lock = threading.Lock()
        self.max_compiles = max_compiles
        self._running = threading.BoundedSemaphore(max_compiles)

    @property
    def backend(self) -> GrammarBackend:
        """The primary backend: it allocates and applies the step's bitmask."""
        return self._get("outlines" if self.backend_name == "outlines" else "xgrammar")

    def _get(self, name: str) -> GrammarBackend:
        with self._lock:  # built on first use: the tokenizer scan costs a moment
            if name not in self._backends:
                if name == "xgrammar":
                    from loraplex.grammar.xgrammar_backend import XGrammarBackend as cls
                else:
                    from loraplex.grammar.outlines_backend import OutlinesBackend as cls
                self._backends[name] = cls(*self._args)
            return self._backends[name]

    def compile(self, spec: StructuredOutputs) -> tuple[StructuredOutputs, str, object]:
        """(spec, backend name, compiled grammar); GrammarError naming the problem otherwise."""
        if not self._running.acquire(blocking=False):
            raise GrammarError(f"{self.max_compiles} grammar compiles are already running (slow specs); retry later")
        future: cf.Future = cf.Future()

        def work() -> None:
            try:
                future.set_result(self._compile(spec))
            except BaseException as exc:  # handed to the waiting caller
                future.set_exception(exc)
            finally:
                self._running.release()

        threading.Thread(target=work, name="loraplex-grammar", daemon=True).start()
        try:
            return future.result(timeout=self.timeout_s)
        except cf.TimeoutError:
            raise GrammarError(f"{spec.kind} took longer than {self.timeout_s:g}s to compile") from None

    def _compile(self, spec: StructuredOutputs) -> tuple[StructuredOutputs, str, object]:
        primary = self.backend
        try:
            return spec, primary.name, primary.compile(spec)
        except UnsupportedKeywordError:
            raise
        except GrammarError as first:
            if self.backend_name != "auto" or spec.kind not in ("regex", "choice", "json"):
                raise
            try:
                return spec, "outlines", self._get("outlines").compile(spec)
            except GrammarError:
                raise first from None

    def new_grammar(self, compiled: tuple[StructuredOutputs, str, object]) -> Grammar:
        spec, name, grammar = compiled
        return self._get(name).new_grammar(grammar, json_like=spec.kind in ("json", "json_object"))

    def apply(self, logits: torch.Tensor, grammars: list[Grammar | None]) -> None:
        """Mask each constrained row of `logits` in place to the tokens its grammar allows."""
        rows = [i for i, g in enumerate(grammars) if g is not None]
        if not rows:
            return
        bitmask = self.backend.allocate_bitmask(logits.shape[0])
        for i in rows:
            grammars[i].fill_bitmask(bitmask, i)
        self.backend.apply_bitmask(logits, bitmask, rows)
