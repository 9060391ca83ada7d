"""The soundness oracle: does a compiled grammar accept exactly the valid instances of a schema?

Cases come from the official JSON-Schema-Test-Suite (a schema and instances marked valid or
invalid) or from a corpus of real-world schemas with instances. An instance is written the way
the bounded-whitespace grammars emit JSON (UTF-8, an integral float as an integer: `1.0` and
`1` are the same JSON Schema number; see `instance_texts` for key order and separators),
tokenized, fed token by token, then a stop token: accepted if for one of those layouts every
token is and the grammar may end there; rejected only if no layout is accepted. Used by the tests (every
case, every backend) and by `benchmarks/schema_coverage.py`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from loraplex.grammar.backend import GrammarError, StructuredOutputs
from loraplex.grammar.json_schema import UnsupportedKeywordError


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


def instance_texts(data, schema) -> list[str]:
    """The instance as written and with its keys in the order the schema first names them
    (grammars emit properties in declaration order; JSON objects have none), each compact and
    with one space after separators (xgrammar's fixed layout)."""
    data = _integral(data)
    order: dict[str, int] = {}
    for text in _strings(schema):
        order.setdefault(text, len(order))
    texts = [json.dumps(value, separators=separators, ensure_ascii=False)
             for value in (data, _reordered(data, order)) for separators in ((",", ":"), (", ", ": "))]
    return list(dict.fromkeys(texts))


def _strings(value):
    """Every key and string in a JSON value, in document order."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            for key, child in reversed(list(item.items())):
                stack.extend((child, key))
        elif isinstance(item, list):
            stack.extend(reversed(item))


def _reordered(data, order: dict[str, int]):
    if isinstance(data, dict):
        keys = sorted(data, key=lambda k: order.get(k, len(order)))
        return {k: _reordered(data[k], order) for k in keys}
    if isinstance(data, list):
        return [_reordered(x, order) for x in data]
    return data


def _integral(data):
    if isinstance(data, float) and math.isfinite(data) and data.is_integer() and abs(data) < 2 ** 63:
        return int(data)
    if isinstance(data, list):
        return [_integral(x) for x in data]
    if isinstance(data, dict):
        return {k: _integral(v) for k, v in data.items()}
    return data


def accepts(manager, compiled, tokenizer, text: str, stop_token_id: int) -> bool:
    """Does a fresh matcher take `text`'s tokens and then a stop token?"""
    grammar = manager.new_grammar(compiled)
    for token in tokenizer.encode(text, add_special_tokens=False):
        if not grammar.accept_token(token):
            return False
    return grammar.accept_token(stop_token_id) and grammar.is_terminated()


def check(manager, tokenizer, case: Case, stop_token_id: int) -> Outcome:
    import time

    start = time.perf_counter()
    try:
        compiled = manager.compile(StructuredOutputs(json=case.schema))
    except UnsupportedKeywordError as exc:
        return Outcome(case, "refused", str(exc))
    except GrammarError as exc:
        return Outcome(case, "error", str(exc))
    outcome = Outcome(case, "compiled", compile_s=time.perf_counter() - start)
    for data, valid, description in case.instances:
        texts = instance_texts(data, case.schema)
        accepted = [accepts(manager, compiled, tokenizer, text, stop_token_id) for text in texts]
        text = texts[accepted.index(True)] if any(accepted) else texts[-1]
        ok = any(accepted) == valid
        if valid:
            outcome.valid_total += 1
            outcome.valid_accepted += ok
        else:
            outcome.invalid_total += 1
            outcome.invalid_rejected += ok
        if not ok:
            outcome.wrong.append((text, valid, description))
    return outcome
