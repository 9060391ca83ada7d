"""llguidance: JSON Schema, json_object, regex, choice and Lark / EBNF grammars, one LLMatcher
per sequence, writing the same packed bitmask as xgrammar.

llguidance says what it cannot enforce instead of ignoring it ("Unimplemented keys", a `oneOf`
whose branches it cannot prove disjoint, an unknown `format`): those become a refusal naming the
keyword. Its JSON has no whitespace between tokens unless `any_whitespace` asks for it.

Tool calls are Lark written per format (grammar/tooling/tool_formats.py); a spec with `reasoning` is
Lark too: the reasoning (grammar/tooling/reasoning.py), then the spec's own grammar as a subgrammar
(tool calls and free text inline).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re

from typing import TYPE_CHECKING

import llguidance
import llguidance.hf

from loraplex.grammar.schema import regex_features

from loraplex.grammar.tooling import reasoning, tools
from loraplex.grammar.backend import CompileCache, GrammarError, StructuredOutputs, UnsatisfiableError
from loraplex.grammar.budget import BudgetGuard, Planner
from loraplex.grammar.schema.ecma_regex import exact_dots
from loraplex.grammar.schema.json_schema import (UnsupportedKeywordError, check_formats, check_patterns, check_regex,
                                          find_keyword, walk)
from loraplex.grammar.schema.schema_values import pointer_parts

if TYPE_CHECKING:  # a compile worker imports this module without torch
    import torch

MAX_CACHED = 256
# the formats llguidance 1.9 has a grammar for (it refuses the others, but lets any string through
# for "unknown"); of the regex features, anchors inside a pattern (it refuses those it cannot place)
FORMATS = frozenset({"date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uuid"})
REGEX_FEATURES = frozenset({regex_features.INNER_ANCHOR})


_EXECUTOR: llguidance.LLExecutor | None = None  # Rust threads that fill many rows at once
_TORCH = None  # llguidance.torch, imported on first fill: compile workers never import torch


def _torch_fill():
    global _TORCH
    if _TORCH is None:
        import llguidance.torch

        _TORCH = llguidance.torch
    return _TORCH


class LLGuidanceGrammar:
    @staticmethod
    def fill_many(rows: list[tuple["LLGuidanceGrammar", int]], bitmask: torch.Tensor) -> None:
        """Fill several sequences' rows at once, in parallel without the GIL."""
        global _EXECUTOR
        if _EXECUTOR is None:
            _EXECUTOR = llguidance.LLExecutor()
        _torch_fill().fill_next_token_bitmask_par(_EXECUTOR, [(g.matcher, row) for g, row in rows], bitmask)

    def __init__(self, matcher: llguidance.LLMatcher, stop_token_ids: frozenset[int]) -> None:
        self.matcher = matcher
        self.stop_token_ids = stop_token_ids
        self.terminated = False  # a stop token accepted where the grammar may end
        self.guard: BudgetGuard | None = None  # set where the output must end valid inside its budget

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        _torch_fill().fill_next_token_bitmask(self.matcher, bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        # never consume_token blindly: a refused token would leave the matcher in an error state
        # for good, and a jump-forward dry run or a caller must be able to go on after a refusal
        if self.terminated:
            return False
        if token_id not in self.stop_token_ids:  # try_consume leaves the matcher as it was on a refusal
            taken = self.matcher.try_consume_tokens([token_id]) == 1
            if taken and self.guard is not None:
                self.guard.accepted(token_id)
            return taken
        self.terminated = self.matcher.is_accepting() and self.matcher.consume_token(token_id)
        return self.terminated

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and self.terminated:  # llguidance keeps no history entry for the stop token
            self.terminated, num_tokens = False, num_tokens - 1
        if num_tokens:
            self.matcher.rollback(num_tokens)
            if self.guard is not None:
                self.guard.rolled_back(num_tokens)

    def is_terminated(self) -> bool:
        return self.terminated

    def is_complete(self, json_value: bool = False) -> bool:
        """Whether the output has ended: the grammar allows nothing more (free text, a regex or a number that may
        go on has not, though it may stop here); for a JSON value or tool calls (`json_value`), where it may end."""
        return self.terminated or self.matcher.is_stopped() or (json_value and self.matcher.is_accepting())

    def jump_forward_string(self) -> str:
        """The text the grammar forces next, cut before a character split across its end."""
        forced = self.matcher.compute_ff_bytes()
        for cut in range(4):
            try:
                return forced[:len(forced) - cut].decode("utf-8")
            except UnicodeDecodeError:
                continue
        return ""


class Markers:
    """Marker texts (`<tool_call>`, `</think>`, ...) as Lark writes them for this tokenizer: the
    model's own token where one token is the marker (llguidance treats added tokens as special
    and keeps them out of text), else the text."""

    def __init__(self, hf_tokenizer, ll_tokenizer: llguidance.LLTokenizer) -> None:
        self._hf, self._ll = hf_tokenizer, ll_tokenizer
        self._tokens: dict[str, int | None] = {}

    def token(self, text: str) -> int | None:
        if text not in self._tokens:
            ids = self._hf.encode(text, add_special_tokens=False)
            special = len(ids) == 1 and self._hf.decode(ids) == text and self._ll.is_special_token(ids[0])
            self._tokens[text] = ids[0] if special else None
        return self._tokens[text]

    def special_ids(self) -> list[int]:
        """The marker tokens written as the model's own tokens so far (what a completion plan may need)."""
        return sorted(t for t in self._tokens.values() if t is not None)

    def __call__(self, text: str) -> str:
        token = self.token(text)
        return f"<[{token}]>" if token is not None else json.dumps(text)


class LLGuidanceBackend:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        stops = list(stop_token_ids) or [tokenizer.eos_token_id]
        self.stop_token_ids = frozenset(stops)
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=stops)
        self.markers = Markers(tokenizer, self.tokenizer)
        self._cache = CompileCache(MAX_CACHED)
        self._planner: Planner | None = None

    @property
    def planner(self) -> Planner:
        """Completion plans for this tokenizer (grammar/budget.py), made on first use."""
        if self._planner is None:
            self._planner = Planner(self.tokenizer)
        return self._planner

    def compile(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        """A validated matcher in its start state; each sequence gets a copy."""
        return self._cache.get_or_build(spec.key, lambda: self._build(spec))

    def _build(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        grammar = self._grammar(spec)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error or messages:  # a warning is something it would not enforce: refused as well
            raise _error(spec, messages[0] if messages else "compile failed")
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise _error(spec, matcher.get_error())
        return matcher

    def _grammar(self, spec: StructuredOutputs) -> str:
        options = {"whitespace_flexible": spec.any_whitespace, "coerce_one_of": False}
        try:
            if spec.reasoning is not None:
                return self._after_reasoning(spec)
            if spec.kind == "json":
                check_formats(spec.json, FORMATS, "llguidance")
                check_patterns(spec.json, REGEX_FEATURES, "llguidance")
                return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(ecma_dots(spec.json)),
                                                                     defaults=options)
            if spec.kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=options)
            if spec.kind == "regex":
                check_regex(spec.regex, REGEX_FEATURES, "llguidance")
                return llguidance.LLMatcher.grammar_from_regex(spec.regex)
            if spec.kind == "choice":
                return llguidance.LLMatcher.grammar_from_lark(
                    "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice))
            if spec.kind == "tools":
                return _lark(["start: tool_calls", *tools.lark_rules(spec.tools, self.markers)])
            return llguidance.LLMatcher.grammar_from_lark(lark_grammar(spec.grammar))
        except GrammarError:
            raise
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"invalid {spec.kind}: {exc}") from None

    def _after_reasoning(self, spec: StructuredOutputs) -> str:
        """The reasoning, then what the spec constrains: tool calls and free text inline, any
        other kind as its own grammar, named `body`."""
        before, rules = reasoning.lark_rules(spec.reasoning, self.markers)
        if spec.kind == "tools":
            return _lark([f"start: {before} tool_calls", *rules, *tools.lark_rules(spec.tools, self.markers)])
        if spec.kind == "text":
            return _lark([f"start: {before} RS_TEXT", *rules, "RS_TEXT: /(.|\\n)*/"])
        body = _grammars(self._grammar(dataclasses.replace(spec, reasoning=None)))
        body[0] = {**body[0], "name": "body"}
        outer = _lark([f"start: {before} @body", *rules])
        return json.dumps({"grammars": [{"lark_grammar": outer}, *body]})

    def export(self, compiled: llguidance.LLMatcher) -> None:
        """What a compile worker sends back: nothing (a matcher does not pickle), since the
        server's own compile of the same exact spec is cheap (llguidance builds lazily)."""
        return None

    def restore(self, spec: StructuredOutputs, exported: None) -> llguidance.LLMatcher:
        return self.compile(spec)

    def new_grammar(self, compiled: llguidance.LLMatcher, json_like: bool = False,
                    plan: tuple[tuple[int, ...], tuple] | None = None) -> LLGuidanceGrammar:
        """`plan`: (the start state's plan, the hints) to guard the output's budget with (grammar/budget.py)."""
        grammar = LLGuidanceGrammar(compiled.deep_copy(), self.stop_token_ids)
        if plan is not None:
            grammar.guard = BudgetGuard(grammar.matcher, self.planner, plan[1], self.stop_token_ids, plan[0])
        return grammar


def ecma_dots(schema):
    """`schema`, or a copy with each `.` in a `pattern` or a `patternProperties` name written as
    ECMA-262 means it (grammar/schema/ecma_regex.py): llguidance's `.` also takes \\r, U+2028 and U+2029.
    The request's own schema is left alone (the output check reads it)."""
    if not any(exact_dots(p) != p for p in _patterns(schema)):
        return schema
    out = copy.deepcopy(schema)
    pointed = _pointed_names(out)
    for node, _ in walk(out):
        if isinstance(node.get("pattern"), str):
            node["pattern"] = exact_dots(node["pattern"])
        named = node.get("patternProperties")
        if isinstance(named, dict) and not pointed & set(named):
            renamed = {exact_dots(name): sub for name, sub in named.items()}
            if len(renamed) == len(named):  # two names that mean the same stay apart
                node["patternProperties"] = renamed
    return out


def _patterns(schema):
    for node, _ in walk(schema):
        if isinstance(node.get("pattern"), str):
            yield node["pattern"]
        if isinstance(node.get("patternProperties"), dict):
            yield from node["patternProperties"]


def _pointed_names(schema) -> set[str]:
    """The `patternProperties` names a local `$ref` passes through (renaming them would break it)."""
    refs = [node["$ref"] for node, _ in walk(schema) if isinstance(node.get("$ref"), str)]
    return {part for ref in refs if ref.startswith("#/") and "patternProperties" in pointer_parts(ref)
            for part in pointer_parts(ref)}


def _lark(lines: list[str]) -> str:
    return llguidance.LLMatcher.grammar_from_lark("\n".join(["%llguidance {}", *lines]))


def _grammars(grammar: str) -> list[dict]:
    """A grammar as llguidance's list of grammars (its JSON form, or one Lark text)."""
    try:
        parsed = json.loads(grammar)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict) and "grammars" in parsed:
        return list(parsed["grammars"])
    return [{"lark_grammar": grammar}]


def lark_grammar(text: str) -> str:
    """Our `grammar` is EBNF in xgrammar's / GBNF's dialect (`root ::= ...`); llguidance reads
    Lark, and takes a Lark grammar as it is."""
    if "::=" not in text:
        return text
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        return gbnf_to_lark(text)
    except Exception as exc:  # its converter raises whatever its parser hits
        raise GrammarError(f"invalid grammar: {exc}") from None


def _error(spec: StructuredOutputs, message: str) -> GrammarError:
    message = message.strip().splitlines()[0] if message.strip() else "compile failed"
    if spec.kind != "json":
        return GrammarError(f"invalid {spec.kind}: {message}")
    unimplemented = re.match(r"Unimplemented keys: \[(.*)\]", message)
    if unimplemented:
        keys = json.loads(f"[{unimplemented.group(1)}]")
        return _refused(spec, keys[0], "it does not implement it")
    if message.startswith("oneOf constraints are not supported"):
        return _refused(spec, "oneOf", "its branches are not provably disjoint, so it would be enforced as anyOf")
    unknown_format = re.match(r"Unknown format: (.*)", message)
    if unknown_format:
        return _refused(spec, f"format: {unknown_format.group(1)}", "it has no grammar for this format", "format")
    for start, keyword, why in _LIMITS:
        if message.startswith(start):
            return _refused(spec, keyword, why)
    if message.startswith("Unsatisfiable schema"):
        return UnsatisfiableError(f"json schema is unsatisfiable: it admits no value at all "
                                  f"({message[len('Unsatisfiable schema: '):]})")
    return GrammarError(f"invalid json: {message}")


# what llguidance reports it cannot build, as the keyword that asks for it: refused by name (no other
# backend enforces more of these)
_LIMITS = (
    ("patternProperty regexes", "patternProperties",
     "two of its patterns (or a pattern and additionalProperties inside allOf) can match one name"),
    ("circular references with sibling keys", "$ref", "a circular reference has sibling keywords"),
    ("Unable to determine if regex is empty", "pattern",
     "its patterns and lengths together are too complex to prove satisfiable"),
    ("Schema intersection stack level exceeded", "allOf", "its schemas nest too deeply to intersect"),
)


def _refused(spec: StructuredOutputs, keyword: str, why: str, key: str | None = None) -> UnsupportedKeywordError:
    path = find_keyword(spec.json, key or keyword) or "#"
    return UnsupportedKeywordError(f"json schema keyword {keyword!r} at {path} is not supported by the llguidance "
                                   f"grammar backend ({why}, so the request is refused)", keyword, path)
