"""Compiles specs off the engine thread, with a timeout, and builds the step's bitmask.

`compile` runs in the caller's thread against a small pool (so the engine never waits for a
grammar, and a slow compile fails only its own request); the backend keeps compiled grammars
in a bounded cache keyed by the spec.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading

import torch

from loraplex.grammar.backend import Grammar, GrammarBackend, GrammarError, StructuredOutputs

BACKENDS = ("xgrammar",)


class GrammarManager:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], backend: str = "xgrammar",
                 timeout_s: float = 10.0, threads: int = 2) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"grammar_backend must be one of {BACKENDS}, got {backend!r}")
        self._args = (tokenizer, vocab_size, stop_token_ids)
        self.backend_name = backend
        self.timeout_s = timeout_s
        self._backend: GrammarBackend | None = None
        self._lock = threading.Lock()
        self._pool = cf.ThreadPoolExecutor(threads, thread_name_prefix="loraplex-grammar")

    @property
    def backend(self) -> GrammarBackend:
        with self._lock:  # built on first use: the tokenizer scan costs a moment
            if self._backend is None:
                from loraplex.grammar.xgrammar_backend import XGrammarBackend

                self._backend = XGrammarBackend(*self._args)
            return self._backend

    def compile(self, spec: StructuredOutputs) -> tuple[StructuredOutputs, object]:
        future = self._pool.submit(self.backend.compile, spec)
        try:
            return spec, future.result(timeout=self.timeout_s)
        except cf.TimeoutError:
            raise GrammarError(f"{spec.kind} took longer than {self.timeout_s:g}s to compile") from None

    def new_grammar(self, compiled: tuple[StructuredOutputs, object]) -> Grammar:
        spec, grammar = compiled
        return self.backend.new_grammar(grammar, json_like=spec.kind in ("json", "json_object"))

    def apply(self, logits: torch.Tensor, grammars: list[Grammar | None]) -> None:
        """Mask each constrained row of `logits` in place to the tokens its grammar allows."""
        rows = [i for i, g in enumerate(grammars) if g is not None]
        if not rows:
            return
        bitmask = self.backend.allocate_bitmask(logits.shape[0])
        for i in rows:
            grammars[i].fill_bitmask(bitmask, i)
        self.backend.apply_bitmask(logits, bitmask, rows)
