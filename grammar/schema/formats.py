"""What a JSON Schema `format` means here, settled before any backend sees the schema.

- A format JSON Schema defines (`json_schema.FORMATS`) stays: the backends enforce it by grammar,
  or refuse it by name where they have no exact grammar for it.
- Any other name is an annotation: in JSON Schema 2020-12 an unknown format constrains nothing,
  so the schema is served exactly with it left out, and the response lists it (`unenforced`).
- A defined format no backend has a grammar for, but whose language is regular (`uri-reference`,
  `json-pointer`: grammar/schema/format_patterns.py), becomes the `pattern` that is exactly it.
- OpenAPI's numeric formats (`int32`, `int64`, `float`, `double`) on a number or integer become
  the range they mean (`minimum` / `maximum`): stricter than an annotation, never looser.
- A caller that asks for strict in OpenAI's sense (`response_format.json_schema.strict: true`, a
  tool's `strict: true`) gets OpenAI's documented list of formats; any other is refused by name.
"""

from __future__ import annotations

import copy

from loraplex.grammar.schema.format_patterns import FORMAT_PATTERNS
from loraplex.grammar.schema.schema_values import dialect
from loraplex.grammar.schema.json_schema import FORMATS, UnsupportedKeywordError, walk

# OpenAI's structured outputs, strict mode: the string formats it documents
OPENAI_FORMATS = frozenset({"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid"})
FLOAT32_MAX = 3.4028234663852886e38
# OpenAPI's numeric formats: (the types they apply to, their range); a double is any JSON number
NUMERIC = {"int32": ({"integer"}, -2**31, 2**31 - 1), "int64": ({"integer"}, -2**63, 2**63 - 1),
           "float": ({"number", "integer"}, -FLOAT32_MAX, FLOAT32_MAX), "double": ({"number", "integer"}, None, None)}


def settle_formats(schema, openai_strict: bool = False) -> tuple[object, tuple[str, ...]]:
    """`schema` with annotation formats left out and numeric formats turned into ranges (a new
    object; the input is left alone), and what was left out, as `unenforced` words it. Raises
    UnsupportedKeywordError for a format OpenAI's strict mode does not list, under `openai_strict`."""
    if not isinstance(schema, dict):
        return schema, ()
    schema, notes = copy.deepcopy(schema), []
    for node, path in walk(schema):
        name = node.get("format")
        if not isinstance(name, str):
            continue
        if openai_strict and name not in OPENAI_FORMATS:
            raise UnsupportedKeywordError(
                f"json schema keyword 'format: {name}' at {path} is not one of the formats OpenAI's strict mode "
                f"supports ({', '.join(sorted(OPENAI_FORMATS))}), so the request is refused (without strict: true, a "
                f"format JSON Schema defines is enforced where a grammar exists and any other is served as an "
                f"annotation)", f"format: {name}", path)
        if name in NUMERIC and _as_range(node, *NUMERIC[name]):
            continue
        if name in FORMAT_PATTERNS and dialect(schema) >= 6:
            _as_pattern(node, FORMAT_PATTERNS[name])
            continue
        if name not in FORMATS or name in FORMAT_PATTERNS:  # draft 4 defines neither of those
            del node["format"]
            notes.append(f"format: {name} at {path} (an annotation: a format JSON Schema does not define "
                         f"constrains nothing)")
    return schema, tuple(notes)


def _as_pattern(node: dict, pattern: str) -> None:
    """The format as the `pattern` that is its language (a string keyword, as `format` is); beside
    a pattern of its own, in an `allOf` (both must match)."""
    del node["format"]
    if "pattern" not in node:
        node["pattern"] = pattern
    else:
        node["allOf"] = [*node.get("allOf", []), {"pattern": pattern}]


def _as_range(node: dict, types: set[str], low, high) -> bool:
    """The numeric format as `minimum` / `maximum` on a node of one of `types` (False where the node
    is not declared a number: the format is then an annotation like any unknown one)."""
    declared = node.get("type")
    if not isinstance(declared, str) or declared not in types:
        return False
    del node["format"]
    if low is not None:
        node["minimum"] = max(node["minimum"], low) if _number(node.get("minimum")) else low
        node["maximum"] = min(node["maximum"], high) if _number(node.get("maximum")) else high
    return True


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
