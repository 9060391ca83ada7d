"""outlines-core: regexes (JSON Schemas and choices become regexes) compiled into a token index,
one Guide per sequence. Writes the same packed bitmask as xgrammar (bit i of word j allows
token 32*j + i), so both backends fill rows of one mask.

What it takes, exactly: `regex` (Rust regex syntax: also Unicode classes such as `\\p{Lu}` and
inline flags such as `(?i)`, which xgrammar refuses), `choice`, and `json` for schemas whose
every keyword outlines enforces (`RULES` lists what it would silently drop or loosen, which
is refused by name). Not `json_object` or EBNF `grammar` (no recursion in a regex), and no
jump-forward.
"""

from __future__ import annotations

import json
import re

import outlines_core as oc

from loraplex.grammar.backend import CompileCache, GrammarError, StructuredOutputs
from loraplex.grammar.schema.json_schema import (BASE_UNENFORCED, SchemaRules, UnsupportedKeywordError, check_regex,
                                          check_schema, subschemas)
from loraplex.grammar.schema.rewrite import resolve_pointer

# what outlines-core 0.2 accepts in a schema but does not enforce (checked against its regexes)
# and the formats it has a regex for, less date-time and time (its regexes make the UTC offset optional)
RULES = SchemaRules("outlines", BASE_UNENFORCED | {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"},
                    formats=frozenset({"date", "email", "uri", "uuid"}))
WHITESPACE = r"[ ]?"  # bounded: at most one space between JSON tokens
MAX_CACHED = 64


class OutlinesGrammar:
    guard = None  # no budget guard (grammar/budget.py): llguidance grammars only

    def __init__(self, index: oc.Index, eos_token_id: int) -> None:
        self.guide = oc.Guide(index, max_rollback=64)
        self.eos_token_id = eos_token_id
        self.terminated = False  # EOS accepted in a final state; the guide itself never sees EOS

    def fill_bitmask(self, bitmask, row: int) -> None:
        target = bitmask[row]
        target.zero_()  # tokens past the tokenizer's vocabulary stay forbidden
        self.guide.write_mask_into(target.data_ptr(), target.numel(), 4)

    def accept_token(self, token_id: int) -> bool:
        if self.terminated:
            return False
        if token_id == self.eos_token_id:
            self.terminated = self.guide.is_finished()
            return self.terminated
        if not self.guide.accepts_tokens([token_id]):
            return False
        self.guide.advance(token_id, return_tokens=False)
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and self.terminated:
            self.terminated, num_tokens = False, num_tokens - 1
        if num_tokens:
            self.guide.rollback_state(num_tokens)

    def is_terminated(self) -> bool:
        return self.terminated

    def jump_forward_string(self) -> str:
        return ""


class OutlinesBackend:
    name = "outlines"

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        eos = tokenizer.eos_token_id
        self.eos_token_id = eos if eos in stop_token_ids or not stop_token_ids else stop_token_ids[0]
        specials = set(tokenizer.all_special_ids) | set(stop_token_ids)
        vocab: dict[bytes, list[int]] = {}
        for token_id, raw in enumerate(token_bytes(tokenizer, vocab_size)):
            if raw and token_id not in specials:
                vocab.setdefault(raw, []).append(token_id)
        self.vocabulary = oc.Vocabulary(self.eos_token_id, vocab)
        self._cache = CompileCache(MAX_CACHED)

    def compile(self, spec: StructuredOutputs) -> oc.Index:
        return self._cache.get_or_build(spec.key, lambda: self._build(spec))

    def _build(self, spec: StructuredOutputs) -> oc.Index:
        regex = self._regex(spec)
        try:
            return oc.Index(regex, self.vocabulary)
        except Exception as exc:  # outlines reports bad regexes as ValueError
            raise GrammarError(f"invalid {spec.kind}: {str(exc).strip().splitlines()[0]}") from None

    def _regex(self, spec: StructuredOutputs) -> str:
        if spec.kind in ("json_object", "grammar"):
            raise GrammarError(f"{spec.kind} is not supported by the outlines backend (a regex cannot recurse); "
                               f"use grammar_backend 'xgrammar' or 'auto'")
        if spec.kind == "choice":
            return "|".join(re.escape(c) for c in spec.choice)
        if spec.kind == "regex":
            check_regex(spec.regex, RULES.regex_features, "outlines")
            return spec.regex
        check_schema(spec.json, RULES)
        fraction = _first(spec.json, _admits_fraction)
        if fraction is not None:
            raise UnsupportedKeywordError(
                f"json schema keyword 'type: number' at {fraction} is not supported by the outlines grammar backend "
                f"(its token index never takes the '.' of a fraction, so valid numbers would be refused)",
                "type: number", fraction)
        cycle = _recursive_ref(spec.json)
        if cycle is not None:
            raise UnsupportedKeywordError(
                f"json schema keyword '$ref' (to {cycle}) is not supported by the outlines grammar backend (it "
                f"recurses, and a regex only unrolls it to a fixed depth)", "$ref", cycle)
        open_object = _first(spec.json, _open_object)
        if open_object is not None:
            raise UnsupportedKeywordError(
                f"json schema keyword 'additionalProperties' at {open_object} is not supported by the outlines "
                f"grammar backend (it emits only the listed properties: give additionalProperties: false, or use "
                f"another backend)", "additionalProperties", open_object)
        try:
            return oc.json_schema.build_regex_from_schema(
                json.dumps(spec.json), whitespace_pattern=r"[\n\t ]*" if spec.any_whitespace else WHITESPACE)
        except Exception as exc:
            raise GrammarError(f"invalid json: {str(exc).strip().splitlines()[0]}") from None

    def export(self, compiled: oc.Index) -> oc.Index:
        """What a compile worker sends back: the index itself, which pickles."""
        return compiled

    def restore(self, spec: StructuredOutputs, exported: oc.Index) -> oc.Index:
        return exported

    def new_grammar(self, compiled: oc.Index, json_like: bool = False) -> OutlinesGrammar:
        return OutlinesGrammar(compiled, self.eos_token_id)



def _first(schema, test) -> str | None:
    """The path of the first schema node that passes `test`, or None."""
    stack = [(schema, "#")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, dict) and test(node):
            return path
        stack.extend(subschemas(node, path))
    return None


def _refs(node) -> set[str]:
    found, stack = set(), [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if isinstance(item.get("$ref"), str):
                found.add(item["$ref"])
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


def _recursive_ref(schema) -> str | None:
    """A local `$ref` that can reach itself, or None."""
    for start in sorted(_refs(schema)):
        seen, todo = set(), [start]
        while todo:
            try:
                target = resolve_pointer(todo.pop(), schema)
            except LookupError:
                continue
            for ref in _refs(target) - seen:
                if ref == start:
                    return start
                seen.add(ref)
                todo.append(ref)
    return None


def _admits_fraction(node: dict) -> bool:
    """Found by the oracle: outlines-core 0.2's index rejects "1.1" here."""
    types = node.get("type")
    values = node.get("enum", []) if isinstance(node.get("enum", []), list) else []
    values = values + ([node["const"]] if "const" in node else [])
    return types == "number" or (isinstance(types, list) and "number" in types) or any(
        isinstance(v, float) for v in values)


def _open_object(node: dict) -> bool:
    """Found by the oracle: outlines-core 0.2 writes objects with the listed properties only."""
    types = node.get("type")
    is_object = types == "object" or (isinstance(types, list) and "object" in types) or "properties" in node
    return is_object and node.get("additionalProperties", True) is not False


def token_bytes(tokenizer, vocab_size: int) -> list[bytes]:
    """Each token id's exact bytes (byte-level BPE and sentencepiece alike), via xgrammar's
    tokenizer analysis, which both backends then agree on."""
    import xgrammar as xgr

    return list(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size).decoded_vocab)
