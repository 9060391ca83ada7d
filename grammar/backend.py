"""What a request may ask for (`StructuredOutputs`) and what a backend must provide.

A backend compiles a spec once (cached by a hash of the spec) and hands out one `Grammar` per
sequence: it fills that sequence's row of the token bitmask, accepts sampled tokens, rolls
back, and says when the output is complete. The sampler sees only bitmasks.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:  # a compile worker imports this module without torch
    import torch


class GrammarError(ValueError):
    """An invalid or unsupported spec, or a compile that failed or timed out. A backend that
    raises it for a spec it cannot build lets `auto` try the next backend."""


class WorkerGone(GrammarError):
    """A compile worker process ended without an answer (killed from outside, or out of memory): the
    server's failure, not the spec's (grammar/compile_pool.py)."""


class RefusedError(GrammarError):
    """A spec refused for soundness: the backend would not enforce it exactly. Final: `auto`
    never hands it to a backend after it, which would enforce less."""


class UnsatisfiableError(RefusedError):
    """A schema that admits no value at all: final too (a backend that built something would accept
    what the schema forbids)."""


# Size caps: a spec is compiled off the engine thread, but a huge one still ties up a compile
# worker and memory; nesting deeper than this only serves to exhaust recursion.
MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH = 256 << 10, 64
MAX_PATTERN_CHARS, MAX_GRAMMAR_CHARS = 16 << 10, 64 << 10
MAX_CHOICES, MAX_CHOICE_CHARS = 1024, 1024


def _depth(value) -> int:
    """Nesting depth of a JSON value, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth > MAX_SCHEMA_DEPTH:
            break
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        stack.extend((child, depth + 1) for child in children)
    return deepest


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one of: a JSON Schema, any JSON object, a regex, a list of choices, an EBNF grammar,
    tool calls (`grammar/tooling/tools.py`); after `reasoning` (grammar/tooling/reasoning.py) if given, which
    alone means free text after it (kind "text": the reasoning's budget is all there is)."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    any_whitespace: bool = False  # JSON: allow free whitespace (bounded otherwise)
    strict: bool = True  # JSON Schema: refuse what cannot be enforced exactly (else drop it, and say so)
    # strict in OpenAI's sense, asked for by name: only the formats OpenAI documents (grammar/schema/formats.py)
    openai_strict: bool = False
    tools: Any = None  # grammar.tools.ToolCalls: each function's own `strict` applies
    # whose compile this is (a tenant's prefix-cache namespace): part of the key, so no cache, at any level,
    # hands one tenant's compile to another, whose timing would tell what the other sent
    namespace: str = ""
    reasoning: Any = None  # grammar.reasoning.Reasoning: the constrained part starts after it

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar", "tools") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1 and not (not given and self.reasoning is not None):
            raise GrammarError(f"structured outputs need exactly one of json, json_object, regex, choice, "
                               f"grammar, tools; got {given or 'none'}")
        if isinstance(self.json, str):
            if len(self.json) > MAX_SCHEMA_BYTES:
                raise GrammarError(f"json schema is larger than {MAX_SCHEMA_BYTES} bytes")
            try:
                object.__setattr__(self, "json", json.loads(self.json))
            except json.JSONDecodeError as exc:
                raise GrammarError(f"json schema is not valid JSON: {exc}") from None
            except RecursionError:
                raise GrammarError(f"json schema nests deeper than {MAX_SCHEMA_DEPTH} levels") from None
            if self.json is None:  # "null" is no schema, and never "any object"
                raise GrammarError("json schema must be an object, got null")
        if self.json is not None:
            self._check_schema()
        if self.choice is not None:
            if not isinstance(self.choice, list) or not self.choice:
                raise GrammarError("choice must be a non-empty list of strings")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise GrammarError("choice must hold non-empty strings only")
            if len(self.choice) > MAX_CHOICES or any(len(c) > MAX_CHOICE_CHARS for c in self.choice):
                raise GrammarError(f"choice: at most {MAX_CHOICES} strings of at most {MAX_CHOICE_CHARS} characters")
        for name, limit in (("regex", MAX_PATTERN_CHARS), ("grammar", MAX_GRAMMAR_CHARS)):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise GrammarError(f"{name} must be a non-empty string")
            if value is not None and len(value) > limit:
                raise GrammarError(f"{name} is longer than {limit} characters")

    def _check_schema(self) -> None:
        if not isinstance(self.json, (dict, bool)):
            raise GrammarError(f"json schema must be an object, got {type(self.json).__name__}")
        if _depth(self.json) > MAX_SCHEMA_DEPTH:
            raise GrammarError(f"json schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
        if len(json.dumps(self.json)) > MAX_SCHEMA_BYTES:
            raise GrammarError(f"json schema is larger than {MAX_SCHEMA_BYTES} bytes")

    @property
    def kind(self) -> str:
        for kind in ("json", "regex", "choice", "grammar", "tools"):
            if getattr(self, kind) is not None:
                return kind
        return "json_object" if self.json_object else "text"

    @property
    def key(self) -> str:
        spec = self.tools.key_payload() if self.tools is not None else getattr(self, self.kind, None)
        payload = {"kind": self.kind, "spec": spec, "ws": self.any_whitespace, "strict": self.strict,
                   "openai_strict": self.openai_strict, "namespace": self.namespace,
                   "reasoning": self.reasoning.key_payload() if self.reasoning is not None else None}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


class CompileCache:
    """Compiled grammars by spec key, bounded: the least recently used one goes first."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._items: OrderedDict[str, Any] = OrderedDict()

    def peek(self, key: str) -> Any:
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key]
        return None

    def put(self, key: str, value: Any) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        if len(self._items) > self.limit:
            self._items.popitem(last=False)

    def get_or_build(self, key: str, build: Callable[[], Any]) -> Any:
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key]
        self._items[key] = built = build()
        if len(self._items) > self.limit:
            self._items.popitem(last=False)
        return built


class Grammar(Protocol):
    guard: Any  # a grammar.budget.BudgetGuard where the output must end valid inside its budget, else None

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None: ...
    def accept_token(self, token_id: int) -> bool: ...
    def rollback(self, num_tokens: int) -> None: ...
    def is_terminated(self) -> bool: ...
    def jump_forward_string(self) -> str: ...


class GrammarBackend(Protocol):
    name: str

    def compile(self, spec: StructuredOutputs) -> Any: ...
    def new_grammar(self, compiled: Any, json_like: bool = False) -> Grammar: ...
