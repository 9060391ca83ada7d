"""The soundness oracle: does a compiled grammar accept exactly the valid instances of a schema?

Cases come from the official JSON-Schema-Test-Suite (a schema and instances marked valid or
invalid) or from a corpus of real-world schemas with instances. An instance is written into a fresh
matcher the way the bounded-whitespace grammars emit JSON (UTF-8, an integral float as an
integer: `1.0` and `1` are the same JSON Schema number), compact or with xgrammar's spaces,
piece by piece with a backtracking search over each object's key order (JSON objects have
none; grammars fix one), then a stop token: accepted if some order takes it all and the
grammar may end there; rejected only if none does. Used by the tests (every
case, every backend) and by `benchmarks/schema_coverage.py`.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from loraplex.grammar.backend import GrammarError, StructuredOutputs
from loraplex.grammar.schema.json_schema import UnsupportedKeywordError


@dataclass
class Case:
    source: str  # "draft2020-12/oneOf.json" or a corpus file name
    description: str
    schema: object
    instances: list[tuple[object, bool, str]]  # (data, valid, description)

    @property
    def keyword(self) -> str:
        return Path(self.source).stem


@dataclass
class Outcome:
    case: Case
    status: str  # "compiled", "refused" (a keyword named), "error" (another compile failure)
    message: str = ""
    wrong: list[tuple[str, bool, str]] = field(default_factory=list)  # (instance text, valid, description)
    compile_s: float = 0.0
    valid_accepted: int = 0
    valid_total: int = 0
    invalid_rejected: int = 0
    invalid_total: int = 0


def suite_cases(root: Path, drafts: tuple[str, ...] = ("draft2020-12", "draft7")) -> list[Case]:
    """Every case of the JSON-Schema-Test-Suite's required tests (not `optional/`)."""
    cases = []
    for draft in drafts:
        for path in sorted((root / "tests" / draft).glob("*.json")):
            for case in json.loads(path.read_text()):
                schema = case["schema"]
                if isinstance(schema, dict) and "$schema" not in schema:  # the folder names its dialect
                    schema = {"$schema": DIALECTS[draft], **schema}
                cases.append(Case(f"{draft}/{path.name}", case["description"], schema,
                                  [(t["data"], _asserted(t), t["description"]) for t in case["tests"]]))
    return cases


DIALECTS = {"draft2020-12": "https://json-schema.org/draft/2020-12/schema",
            "draft7": "http://json-schema.org/draft-07/schema#"}


def _asserted(test: dict) -> bool:
    """The suite's verdict, with `format` read as an assertion: structured outputs enforce it
    (as OpenAI's strict mode does), so a string the format forbids is invalid here."""
    return test["valid"] and "only an annotation by default" not in test["description"]


def corpus_cases(root: Path) -> list[Case]:
    """Real-world schemas with instances: `{"schema", "tests": [{"data", "valid", ...}]}` files."""
    cases = []
    for path in sorted(root.glob("*.json")):
        item = json.loads(path.read_text())
        cases.append(Case(path.name, item.get("description", ""), item["schema"],
                          [(t["data"], t["valid"], t.get("description", "")) for t in item.get("tests", [])]))
    return cases


SEPARATORS = ((",", ":"), (", ", ": "))  # compact, and xgrammar's fixed layout
MAX_TRIES = 4000  # fragments tried per instance while searching key orders


class _Writer:
    """Writes a JSON value into a grammar fragment by fragment, searching the order of each
    object's keys with backtracking: JSON objects have no order, grammars emit one."""

    def __init__(self, new_grammar, tokenizer, separators: tuple[str, str]) -> None:
        self.new_grammar, self.tokenizer = new_grammar, tokenizer
        self.item_sep, self.key_sep = separators
        self.grammar = new_grammar()
        self.fed: list[int] = []
        self.tries = 0

    def rewind(self, mark: int) -> None:
        """Back to `mark` tokens: a fresh matcher replays them (backends bound rollback)."""
        if len(self.fed) != mark:
            self.grammar, self.fed = self.new_grammar(), self.fed[:mark]
            for token in self.fed:
                self.grammar.accept_token(token)

    def text(self, text: str) -> bool:
        self.tries += 1
        mark = len(self.fed)
        for token in self.tokenizer.encode(text, add_special_tokens=False):
            if not self.grammar.accept_token(token):
                self.rewind(mark)
                return False
            self.fed.append(token)
        return True

    def value(self, value) -> bool:
        mark = len(self.fed)
        if isinstance(value, dict):
            ok = self.text("{") and self.members(list(value.items()), first=True)
        elif isinstance(value, list):
            ok = self.text("[") and all((i == 0 or self.text(self.item_sep)) and self.value(item)
                                        for i, item in enumerate(value)) and self.text("]")
        else:
            ok = self.text(json.dumps(value, ensure_ascii=False))
        if not ok:
            self.rewind(mark)
        return ok

    def members(self, items: list, first: bool) -> bool:
        if not items:
            return self.text("}")
        for i, (key, value) in enumerate(items):
            if self.tries > MAX_TRIES:
                return False
            mark = len(self.fed)
            head = ("" if first else self.item_sep) + json.dumps(key, ensure_ascii=False) + self.key_sep
            if self.text(head) and self.value(value) and self.members(items[:i] + items[i + 1:], first=False):
                return True
            self.rewind(mark)
        return False

def _integral(data):
    if isinstance(data, float) and math.isfinite(data) and data.is_integer() and abs(data) < 2 ** 63:
        return int(data)
    if isinstance(data, list):
        return [_integral(x) for x in data]
    if isinstance(data, dict):
        return {k: _integral(v) for k, v in data.items()}
    return data


def accepts(manager, compiled, tokenizer, data, stop_token_id: int) -> bool:
    """Does a fresh matcher take the value `data`, in some key order and separator layout, then
    a stop token?"""
    data = _integral(data)
    for separators in SEPARATORS:
        writer = _Writer(lambda: manager.new_grammar(compiled), tokenizer, separators)
        if writer.value(data) and writer.grammar.accept_token(stop_token_id) and writer.grammar.is_terminated():
            return True
    return False


def check(manager, tokenizer, case: Case, stop_token_id: int) -> Outcome:
    start = time.perf_counter()
    try:
        compiled = manager.compile(StructuredOutputs(json=case.schema))
    except UnsupportedKeywordError as exc:
        return Outcome(case, "refused", str(exc))
    except GrammarError as exc:
        return Outcome(case, "error", str(exc))
    outcome = Outcome(case, "compiled", compile_s=time.perf_counter() - start)
    for data, valid, description in case.instances:
        text = json.dumps(data, ensure_ascii=False)
        ok = accepts(manager, compiled, tokenizer, data, stop_token_id) == valid
        if valid:
            outcome.valid_total += 1
            outcome.valid_accepted += ok
        else:
            outcome.invalid_total += 1
            outcome.invalid_rejected += ok
        if not ok:
            outcome.wrong.append((text, valid, description))
    return outcome
