r"""Compiles specs off the engine thread, with a timeout, and builds the step's bitmask.

`compile` waits in the caller's thread for a compile running on a thread of its own (so the
engine never waits for a grammar, and a slow compile fails only its own request). A compile
past its timeout is abandoned, not joined: it finishes in the background without holding up
the next spec (a shared pool would stay wedged by it), and at most `max_compiles` may run at
once, abandoned ones included, so slow specs cannot pile up threads. Each backend keeps
compiled grammars in a bounded cache keyed by the spec.

Backends: "llguidance", "xgrammar", "outlines", or "auto" (the default): per spec, the first
of llguidance, xgrammar, outlines that compiles it, a refusal included (each backend refuses by
name what it would not enforce exactly, checked by the oracle in tests/grammar/test_oracle.py,
so passing a refused spec on is sound). All write the same packed bitmask. Before any backend,
a JSON Schema is rewritten exactly (grammar/json_schema.py `normalize`); with `strict: false`
a keyword the first backend refuses is dropped and listed (`Compiled.unenforced`), one at a
time. Every finished JSON output is checked against the schema as given (`Compiled.violation`).

Tool calls and specs after a reasoning prefix (grammar/reasoning.py) are llguidance Lark; the
latter's matchers are wrapped in a `ReasoningGate` (the reasoning budget, and no closing steer
while the model thinks).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import threading
from dataclasses import dataclass, field

import torch

from loraplex.grammar.backend import Grammar, GrammarBackend, GrammarError, StructuredOutputs
from loraplex.grammar.json_schema import UnsupportedKeywordError, normalize, relaxed
from loraplex.grammar.reasoning import CLOSE, ReasoningGate
from loraplex.grammar.tool_formats import tool_format
from loraplex.grammar.tools import ToolCallError, ToolCalls, parse_tool_calls

BACKENDS = ("xgrammar", "llguidance", "outlines", "auto")
AUTO_ORDER = ("llguidance", "xgrammar", "outlines")
KINDS = {"llguidance": {"json", "json_object", "regex", "choice", "grammar", "tools"},
         "xgrammar": {"json", "json_object", "regex", "choice", "grammar"},
         "outlines": {"json", "regex", "choice"}}
MAX_RELAXED = 64  # keywords a non-strict schema may drop


def _normalized(spec: StructuredOutputs, deep: bool) -> StructuredOutputs:
    """A JSON Schema after the exact rewrites (the deep ones put `allOf` beside other keywords,
    which only llguidance enforces everywhere)."""
    if spec.kind != "json":
        return spec
    try:
        return dataclasses.replace(spec, json=normalize(spec.json, deep=deep))
    except GrammarError:  # the rewrite outgrew the size or depth caps: the request's own form
        return dataclasses.replace(spec, json=normalize(spec.json, deep=False))


@dataclass
class Compiled:
    """A spec as compiled by one backend; `unenforced` lists what a non-strict schema dropped."""

    spec: StructuredOutputs  # after exact rewrites and what was dropped
    backend: str
    grammar: object
    unenforced: tuple[str, ...] = ()
    original: object = None  # the schema as the request gave it, for the output check
    _validator: object = field(default=None, repr=False)
    _tool_validators: dict = field(default_factory=dict, repr=False)  # by function name

    @property
    def ends_in_json(self) -> bool:
        """Whether the output is JSON all the way to its end (a JSON spec, or calls only), so
        steering it toward closing tokens near max_tokens never bends free text."""
        return self.spec.kind in ("json", "json_object") or (self.spec.kind == "tools" and self.spec.tools.required)

    def violation(self, text: str) -> str | None:
        """Why a finished JSON output breaks the request's schema, or None: the backstop run
        on every structured output before it is returned."""
        if self.spec.kind == "tools":
            return self._tools_violation(text)
        if self.spec.kind not in ("json", "json_object"):
            return None
        try:
            value = json.loads(text)
        except ValueError as exc:
            return f"not JSON: {exc}"
        if self.spec.kind == "json_object":
            return None if isinstance(value, dict) else f"not a JSON object: {type(value).__name__}"
        try:
            if self._validator is None:
                self._validator = json_validator(self.original if self.original is not None else self.spec.json)
            return schema_error(self._validator, value)
        except Exception:  # a schema the validator itself cannot run (a regex it cannot read): unchecked
            return None


    def _tools_violation(self, text: str) -> str | None:
        """Each call's arguments against its function's parameters as the request gave them."""
        calls: ToolCalls = self.original
        try:
            _, parsed = parse_tool_calls(text, calls.format)
        except ToolCallError as exc:
            return str(exc)
        if calls.required and not parsed:
            return "no complete tool call"
        if not calls.parallel and len(parsed) > 1:
            return f"{len(parsed)} tool calls where one was allowed"
        by_name = {f.name: f for f in calls.functions}
        for call in parsed:
            if call.name not in by_name:
                return f"a call to {call.name!r}, which is not an allowed tool"
            try:
                if call.name not in self._tool_validators:
                    self._tool_validators[call.name] = json_validator(by_name[call.name].object_schema())
                error = schema_error(self._tool_validators[call.name], json.loads(call.arguments))
            except Exception:  # a schema the validator itself cannot run: unchecked
                continue
            if error is not None:
                return f"tool {call.name} arguments: {error}"
        return None


def json_validator(schema):
    """A `jsonschema` validator for the schema's own draft, with `format` asserted (as the
    grammars enforce it)."""
    import jsonschema  # here, not at import: the engine must import where only torch and transformers are

    cls = jsonschema.validators.validator_for(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def schema_error(validator, value) -> str | None:
    """The most relevant way `value` breaks the validator's schema, or None."""
    import jsonschema

    error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    return None if error is None else f"{error.message} at {error.json_path}"


class GrammarManager:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], backend: str = "xgrammar",
                 timeout_s: float = 10.0, max_compiles: int = 8) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"grammar_backend must be one of {BACKENDS}, got {backend!r}")
        self._args = (tokenizer, vocab_size, stop_token_ids)
        self.backend_name = backend
        self.timeout_s = timeout_s
        self._backends: dict[str, GrammarBackend] = {}
        self._unavailable: dict[str, str] = {}  # backends that failed to build, and why (not retried)
        self._lock = threading.Lock()
        self.max_compiles = max_compiles
        self._running = threading.BoundedSemaphore(max_compiles)
        self.token_texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
        self.closing_tokens = _closing_tokens(self.token_texts, stop_token_ids, vocab_size)
        self._closers: dict[torch.device, torch.Tensor] = {}
        self.close_ids = tokenizer.encode(CLOSE, add_special_tokens=False)  # what a reasoning budget forces


    def _get(self, name: str) -> GrammarBackend:
        with self._lock:  # built on first use: the tokenizer scan costs a moment
            if name in self._unavailable:
                raise GrammarError(self._unavailable[name])
            if name not in self._backends:
                if name == "xgrammar":
                    from loraplex.grammar.xgrammar_backend import XGrammarBackend as cls
                elif name == "llguidance":
                    from loraplex.grammar.llguidance_backend import LLGuidanceBackend as cls
                else:
                    from loraplex.grammar.outlines_backend import OutlinesBackend as cls
                try:
                    self._backends[name] = cls(*self._args)
                except Exception as exc:  # e.g. llguidance takes fast tokenizers only: auto goes on to the next
                    self._unavailable[name] = f"the {name} grammar backend cannot serve this model's tokenizer: {exc}"
                    raise GrammarError(self._unavailable[name]) from None
            return self._backends[name]

    def compile(self, spec: StructuredOutputs) -> Compiled:
        """The compiled spec; GrammarError naming the problem otherwise."""
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

    def order(self, spec: StructuredOutputs) -> tuple[str, ...]:
        """The backends tried for `spec`, in turn: one, or under auto every backend that may
        take its kind, best first."""
        if self.backend_name != "auto":
            return (self.backend_name,)
        return tuple(name for name in AUTO_ORDER if spec.kind in KINDS[name])

    def _llguidance_only(self, what: str) -> None:
        if self.backend_name not in ("auto", "llguidance"):
            raise GrammarError(f"{what} need the llguidance grammar backend (this server runs {self.backend_name})")

    def _compile(self, spec: StructuredOutputs, order: tuple[str, ...] | None = None) -> Compiled:
        if spec.reasoning is not None:
            return self._compile_reasoning(spec)
        if spec.kind == "tools":
            return self._compile_tools(spec)
        order = order or self.order(spec)
        try:
            compiled = self._first_that_compiles(spec, order)
        except UnsupportedKeywordError as refused:
            if spec.strict:
                raise
            compiled = self._relax(spec, order[0], refused)
        compiled.original = spec.json
        return compiled

    def _compile_tools(self, spec: StructuredOutputs) -> Compiled:
        """Tool calls: llguidance only (the grammar is Lark with inline schemas). Each function's
        parameters go through the format's own refusals, then the same rewrites, refusals and
        `strict: false` relaxing as a response_format schema; then the whole grammar compiles."""
        self._llguidance_only("tool calls")
        functions, unenforced = [], []
        for function in spec.tools.functions:
            try:
                schema, dropped = self._format_schema(spec.tools.format, function)
                alone = StructuredOutputs(json=schema, strict=function.strict)
                try:
                    compiled = self._first_that_compiles(alone, ("llguidance",), dropped)
                except UnsupportedKeywordError as refused:
                    if function.strict:
                        raise
                    compiled = self._relax(alone, "llguidance", refused, dropped)
            except GrammarError as exc:
                raise GrammarError(f"tool {function.name} parameters: {exc}") from None
            functions.append(dataclasses.replace(function, parameters=compiled.spec.json))
            unenforced += [f"{dropped} in tool {function.name}" for dropped in compiled.unenforced]
        exact = dataclasses.replace(spec, tools=dataclasses.replace(spec.tools, functions=tuple(functions)))
        compiled = Compiled(exact, "llguidance", self._get("llguidance").compile(exact), tuple(unenforced))
        compiled.original = spec.tools
        return compiled

    def _format_schema(self, format: str, function) -> tuple[dict, list[str]]:
        """The function's arguments schema as its format can write it: what the format refuses
        raises, or under `strict: false` is dropped and listed."""
        fmt, dropped = tool_format(format), []
        schema = fmt.arguments_schema(function)
        for _ in range(MAX_RELAXED):
            refused = fmt.refusal(schema)
            if refused is None:
                return schema, dropped
            lighter = relaxed(schema, refused.keyword, refused.path) \
                if isinstance(refused, UnsupportedKeywordError) and not function.strict else None
            if lighter is None:
                raise refused
            dropped.append(f"{refused.keyword} at {refused.path}")
            schema = lighter
        raise GrammarError(f"more than {MAX_RELAXED} keywords to drop")

    def _compile_reasoning(self, spec: StructuredOutputs) -> Compiled:
        """A spec after reasoning: the spec compiled alone by llguidance (its refusals, its
        relaxing), then the whole as one Lark grammar (grammar/reasoning.py)."""
        self._llguidance_only("structured outputs after reasoning (--reasoning-parser)")
        alone = None if spec.kind == "text" else self._compile(dataclasses.replace(spec, reasoning=None),
                                                               ("llguidance",))
        exact = dataclasses.replace(alone.spec if alone is not None else spec, reasoning=spec.reasoning)
        compiled = Compiled(exact, "llguidance", self._get("llguidance").compile(exact),
                            alone.unenforced if alone is not None else ())
        compiled.original = alone.original if alone is not None else None
        return compiled

    def _first_that_compiles(self, spec: StructuredOutputs, order: tuple[str, ...], unenforced=()) -> Compiled:
        first: GrammarError | None = None
        for name in order:
            error = None
            for deep in (True, False) if spec.kind == "json" and name != "llguidance" else (True,):
                try:
                    exact = _normalized(spec, deep)
                    return Compiled(exact, name, self._get(name).compile(exact), tuple(unenforced))
                except GrammarError as exc:  # refused or failed: the next backend may enforce it exactly
                    error = exc  # the light rewrite's refusal names the request's own keyword
            first = first or error
        raise first

    def _relax(self, spec: StructuredOutputs, backend: str, refused: UnsupportedKeywordError,
               unenforced: list[str] | None = None) -> Compiled:
        """strict: false: drop what `backend` refuses, one keyword at a time, and list it."""
        spec = _normalized(spec, deep=backend == "llguidance")
        unenforced = list(unenforced or [])
        for _ in range(MAX_RELAXED):
            schema = relaxed(spec.json, refused.keyword, refused.path)
            if schema is None:
                break
            unenforced.append(f"{refused.keyword} at {refused.path}")
            spec = dataclasses.replace(spec, json=schema)
            try:
                return self._first_that_compiles(spec, (backend,), unenforced)
            except UnsupportedKeywordError as exc:
                refused = exc
        raise refused

    def new_grammar(self, compiled: Compiled) -> Grammar:
        spec = compiled.spec
        grammar = self._get(compiled.backend).new_grammar(compiled.grammar, json_like=spec.kind in
                                                          ("json", "json_object") and spec.reasoning is None)
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
