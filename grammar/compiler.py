"""The compile chain, without torch: what a spec becomes (`Compiled`), by which backend.

Run by the server for tests and offline tools (`workers=0`) and by each compile worker process
(grammar/compile_pool.py). Backends: "llguidance", "xgrammar", "outlines", or "auto": per spec
the first of llguidance, xgrammar, outlines that builds it. A backend that cannot build a spec
(a plain `GrammarError`: its parser lacks a syntax, it takes no such kind) lets the next one
try; one that refuses it for soundness (`RefusedError`: a keyword, format or regex feature it
would not enforce exactly) ends the chain, since each backend after it enforces less. A JSON
Schema is first validated against its draft's metaschema, then rewritten exactly
(grammar/schema/json_schema.py `normalize`); with `strict: false` a keyword the refusing backend names
is dropped and listed (`Compiled.unenforced`), one at a time. Every finished JSON output is
checked against the schema as given (`Compiled.violation`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import threading
from dataclasses import dataclass, field
from typing import Callable

from loraplex.grammar.backend import GrammarBackend, GrammarError, RefusedError, StructuredOutputs, UnsatisfiableError
from loraplex.grammar.schema.formats import settle_formats
from loraplex.grammar.schema.json_schema import UnsupportedKeywordError, check_metaschema, normalize, relaxed
from loraplex.grammar.tooling.tool_formats import tool_format
from loraplex.grammar.tooling.tools import ToolCallError, ToolCalls, parse_tool_calls

log = logging.getLogger(__name__)

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
    """A spec as compiled by one backend; `unenforced` lists what a non-strict schema dropped and the
    annotations left out (formats JSON Schema does not define, grammar/schema/formats.py)."""

    spec: StructuredOutputs  # after exact rewrites and what was dropped
    backend: str
    grammar: object
    unenforced: tuple[str, ...] = ()
    original: object = None  # the schema as the request gave it, for the output check
    _validator: object = field(default=None, repr=False)
    _tool_validators: dict = field(default_factory=dict, repr=False)  # by function name
    # (the start state's completion plan, the hints) where the budget is guarded (grammar/budget.py); False: none
    budget_plan: object = field(default=None, repr=False)

    @property
    def ends_in_json(self) -> bool:
        """Whether the output is JSON all the way to its end (a JSON spec, or calls only), so
        steering it toward closing tokens near max_tokens never bends free text."""
        return self.spec.kind in ("json", "json_object") or (self.spec.kind == "tools" and self.spec.tools.required)

    def strict_about(self, violation: str) -> bool:
        """Whether `violation` breaks a promise (strict: a bug) or only what a `strict: false` schema or tool
        relaxed (each tool's own `strict` decides for its calls)."""
        if self.spec.kind == "tools":
            named = re.match(r"tool (\S+) arguments: ", violation)
            functions = {f.name: f for f in self.original.functions}
            if named and named.group(1) in functions:
                return self.spec.strict and functions[named.group(1)].strict
        return self.spec.strict

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


def backend_class(name: str):
    if name == "xgrammar":
        from loraplex.grammar.backends.xgrammar_backend import XGrammarBackend as cls
    elif name == "llguidance":
        from loraplex.grammar.backends.llguidance_backend import LLGuidanceBackend as cls
    else:
        from loraplex.grammar.backends.outlines_backend import OutlinesBackend as cls
    return cls


class SpecCompiler:
    """The backends (each built on first use: the tokenizer scan costs a moment) and the chain
    that picks one per spec."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], backend: str = "auto",
                 on_build: Callable[[bool], None] | None = None) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"grammar_backend must be one of {BACKENDS}, got {backend!r}")
        self._args = (tokenizer, vocab_size, stop_token_ids)
        self.backend_name = backend
        self._backends: dict[str, GrammarBackend] = {}
        self._unavailable: dict[str, str] = {}  # backends that failed to build, and why (not retried)
        self._lock = threading.Lock()
        self.on_build = on_build  # told when a backend build starts and ends (a worker's clock stops)

    def get(self, name: str) -> GrammarBackend:
        with self._lock:
            if name in self._unavailable:
                raise GrammarError(self._unavailable[name])
            if name not in self._backends:
                if self.on_build is not None:
                    self.on_build(True)
                try:
                    self._backends[name] = backend_class(name)(*self._args)
                except Exception as exc:  # e.g. llguidance takes fast tokenizers only: auto goes on to the next
                    self._unavailable[name] = f"the {name} grammar backend cannot serve this model's tokenizer: {exc}"
                    raise GrammarError(self._unavailable[name]) from None
                finally:
                    if self.on_build is not None:
                        self.on_build(False)
            return self._backends[name]

    def order(self, spec: StructuredOutputs) -> tuple[str, ...]:
        """The backends tried for `spec`, in turn: one, or under auto every backend that may
        take its kind, best first."""
        if self.backend_name != "auto":
            return (self.backend_name,)
        return tuple(name for name in AUTO_ORDER if spec.kind in KINDS[name])

    def _llguidance_only(self, what: str) -> None:
        if self.backend_name not in ("auto", "llguidance"):
            raise GrammarError(f"{what} need the llguidance grammar backend (this server runs {self.backend_name})")

    def compile(self, spec: StructuredOutputs, order: tuple[str, ...] | None = None) -> Compiled:
        """The compiled spec; GrammarError naming the problem otherwise."""
        if spec.reasoning is not None:
            return self._compile_reasoning(spec)
        if spec.kind == "tools":
            return self._compile_tools(spec)
        original, annotations = spec.json, ()
        if spec.kind == "json":
            check_metaschema(spec.json)
            settled, annotations = settle_formats(spec.json, spec.openai_strict)
            spec = dataclasses.replace(spec, json=settled)
        order = order or self.order(spec)
        try:
            compiled = self._first_that_compiles(spec, order, annotations)
        except UnsupportedKeywordError as refused:
            if spec.strict or spec.kind != "json":
                raise
            compiled = self._relax(spec, getattr(refused, "backend", order[0]), refused, list(annotations))
        compiled.original = original
        return compiled

    def _compile_tools(self, spec: StructuredOutputs) -> Compiled:
        """Tool calls: llguidance only (the grammar is Lark with inline schemas). Each function's
        parameters go through the metaschema and the format's own refusals, then the same rewrites,
        refusals and `strict: false` relaxing as a response_format schema; then the whole grammar
        compiles."""
        self._llguidance_only("tool calls")
        functions, unenforced = [], []
        for function in spec.tools.functions:
            try:
                if isinstance(function.parameters, dict):
                    check_metaschema(function.parameters, "the parameters schema")
                schema, dropped = self._format_schema(spec.tools.format, function)
                schema, annotations = settle_formats(schema, function.openai_strict)
                dropped += annotations
                alone = StructuredOutputs(json=schema, strict=function.strict)
                try:
                    compiled = self._first_that_compiles(alone, ("llguidance",), dropped)
                except UnsupportedKeywordError as refused:
                    if function.strict:
                        raise
                    compiled = self._relax(alone, "llguidance", refused, dropped)
            except GrammarError as exc:
                raise type(exc)(*_with_prefix(exc, f"tool {function.name} parameters: ")) from None
            functions.append(dataclasses.replace(function, parameters=compiled.spec.json))
            unenforced += [f"{dropped} in tool {function.name}" for dropped in compiled.unenforced]
        exact = dataclasses.replace(spec, tools=dataclasses.replace(spec.tools, functions=tuple(functions)))
        compiled = Compiled(exact, "llguidance", self.get("llguidance").compile(exact), tuple(unenforced))
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
        relaxing), then the whole as one Lark grammar (grammar/tooling/reasoning.py)."""
        self._llguidance_only("structured outputs after reasoning (--reasoning-parser)")
        alone = None if spec.kind == "text" else self.compile(dataclasses.replace(spec, reasoning=None),
                                                              ("llguidance",))
        exact = dataclasses.replace(alone.spec if alone is not None else spec, reasoning=spec.reasoning)
        compiled = Compiled(exact, "llguidance", self.get("llguidance").compile(exact),
                            alone.unenforced if alone is not None else ())
        compiled.original = alone.original if alone is not None else None
        return compiled

    def _first_that_compiles(self, spec: StructuredOutputs, order: tuple[str, ...], unenforced=()) -> Compiled:
        first: GrammarError | None = None
        for name in order:
            error, refused = None, None
            for deep in (True, False) if spec.kind == "json" else (True,):
                try:
                    exact = _normalized(spec, deep)
                    return Compiled(exact, name, self.get(name).compile(exact), tuple(unenforced))
                except UnsatisfiableError:  # the answer, whatever a lighter rewrite would say
                    raise
                except RefusedError as exc:  # the light rewrite's refusal names the request's own keyword
                    error = refused = exc
                except GrammarError as exc:  # this backend cannot build it: the next one may
                    error = exc
            if refused is not None:  # final: every backend after this one enforces less
                refused.backend = name
                raise first or refused  # an earlier backend's own failure stays the reason given
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


def _with_prefix(exc: GrammarError, prefix: str) -> tuple:
    """The error's constructor arguments with its message prefixed (a keyword refusal keeps its
    keyword and path, so `strict: false` callers and workers still see what it is)."""
    if isinstance(exc, UnsupportedKeywordError):
        return prefix + str(exc), exc.keyword, exc.path
    return (prefix + str(exc),)
