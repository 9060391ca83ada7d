"""xgrammar: compiled grammars with a bounded cache, one GrammarMatcher per sequence."""

from __future__ import annotations

import json
import re

import numpy as np
import torch
import xgrammar as xgr

from loraplex.grammar.backend import GrammarError, StructuredOutputs
from loraplex.grammar.schema.json_schema import BASE_UNENFORCED, SchemaRules, check_regex, check_schema

MAX_WHITESPACE = 2  # JSON separators without any_whitespace: no runaway spaces or newlines
# formats xgrammar 0.2.9 has a grammar for (it lets any string through for the others); no regex
# feature of grammar/schema/regex_features.py: inside a schema it drops a lookahead, reads `\A` as "A"
RULES = SchemaRules("xgrammar", BASE_UNENFORCED, formats=frozenset({
    "date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uri-reference", "uuid",
    "uri-template", "json-pointer", "relative-json-pointer"}))


class XGrammarGrammar:
    guard = None  # no budget guard (grammar/budget.py): llguidance grammars only

    def __init__(self, compiled: xgr.CompiledGrammar, allowed: torch.Tensor | None = None) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)
        self.allowed = allowed  # packed bitmask row ANDed into every fill

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if self.allowed is not None:
            bitmask[row] &= self.allowed

    def accept_token(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def jump_forward_string(self) -> str:
        """The text the grammar forces next (empty when there is a choice)."""
        return self.matcher.find_jump_forward_string()


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        # the model's vocab size: its logits can be wider than the tokenizer's vocabulary
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.vocab_size = vocab_size
        self.info = info
        # its own cache is keyed by the schema alone, below the namespaces of GrammarManager's (a tenant would
        # time another's compiles through it): that cache, keyed by the spec with its namespace, is the only one
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.json_allowed = self._without_control_characters(info)

    def _without_control_characters(self, info: xgr.TokenizerInfo) -> torch.Tensor:
        """xgrammar's JSON strings admit raw control characters (only CR and LF are excluded),
        which JSON forbids: JSON grammars never offer a token holding a byte below 0x20, save
        tab / LF / CR between values when any_whitespace allows them."""
        allowed = np.ones(-(-self.vocab_size // 32) * 32, dtype=bool)
        for token_id, raw in enumerate(info.decoded_vocab):
            if token_id in info.special_token_ids or token_id in info.stop_token_ids:
                continue
            allowed[token_id] = not any(b < 0x20 and b not in (9, 10, 13) for b in raw)
        packed = np.packbits(allowed, bitorder="little").view("<i4")
        return torch.from_numpy(packed.copy())

    def compile(self, spec: StructuredOutputs) -> xgr.CompiledGrammar:
        try:
            if spec.kind == "json":
                check_schema(spec.json, RULES)
                return self.compiler.compile_json_schema(
                    json.dumps(spec.json), any_whitespace=spec.any_whitespace, strict_mode=False,
                    max_whitespace_cnt=None if spec.any_whitespace else MAX_WHITESPACE)
            if spec.kind == "json_object":  # any object (the builtin JSON grammar admits any value)
                return self.compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=spec.any_whitespace, strict_mode=False,
                    max_whitespace_cnt=None if spec.any_whitespace else MAX_WHITESPACE)
            if spec.kind == "regex":
                check_regex(spec.regex, RULES.regex_features, "xgrammar")
                return self.compiler.compile_regex(spec.regex)
            if spec.kind == "choice":
                # literal UTF-8: json.dumps' default \ud83d\ude00 for an emoji would be read by
                # the EBNF parser as two lone surrogates that no token can ever match
                return self.compiler.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice))
            return self.compiler.compile_grammar(spec.grammar)
        except GrammarError:
            raise
        except Exception as exc:  # xgrammar reports bad specs as RuntimeError / ValueError
            raise GrammarError(f"invalid {spec.kind}: {_clean(str(exc))}") from None

    def export(self, compiled: xgr.CompiledGrammar) -> str:
        """What a compile worker sends back: the compiled grammar as JSON (restoring it does not
        compile again)."""
        return compiled.serialize_json()

    def restore(self, spec: StructuredOutputs, exported: str) -> xgr.CompiledGrammar:
        return xgr.CompiledGrammar.deserialize_json(exported, self.info)

    def new_grammar(self, compiled: xgr.CompiledGrammar, json_like: bool = False) -> XGrammarGrammar:
        return XGrammarGrammar(compiled, self.json_allowed if json_like else None)



def _clean(message: str) -> str:
    """xgrammar's first line without its '[time] /source/file.cc:line:' prefix."""
    line = message.strip().splitlines()[0] if message.strip() else "compile failed"
    return re.sub(r"^\[[\d:]+\]\s*\S+:\d+:\s*", "", line)
