"""JSON Schema before a backend sees it: exact rewrites (`normalize`), and the rules that refuse,
by name, what a backend would not enforce (`check_schema`), instead of silently generating
output that ignores it. The rules are checked against the JSON-Schema-Test-Suite
(`grammar/schema/oracle.py`, tests/grammar/test_oracle.py): a backend that compiles a schema accepts
exactly its valid instances.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from loraplex.grammar.schema import regex_features
from loraplex.grammar.backend import GrammarError, RefusedError
from loraplex.grammar.schema.rewrite import hoist_refs, rewrite

# Keywords whose value is a schema, or a map / list of schemas, to walk into.
SUBSCHEMA = {"items", "additionalProperties", "additionalItems", "not", "if", "then", "else", "contains",
             "propertyNames", "unevaluatedItems", "unevaluatedProperties"}
SUBSCHEMA_MAPS = {"properties", "$defs", "definitions", "patternProperties", "dependentSchemas"}
SUBSCHEMA_LISTS = {"anyOf", "oneOf", "allOf", "prefixItems"}
# Keywords that constrain nothing: they may sit beside anything.
ANNOTATIONS = {"$schema", "$id", "$comment", "title", "description", "default", "examples", "$defs", "definitions",
               "deprecated", "readOnly", "writeOnly", "contentMediaType", "contentEncoding", "contentSchema"}
# Keywords that apply to one kind of value only (a JSON Schema ignores them for other kinds).
KIND_KEYWORDS = {
    "string": {"minLength", "maxLength", "pattern", "format"},
    "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
    "array": {"items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems", "contains",
              "minContains", "maxContains", "unevaluatedItems"},
    "object": {"properties", "required", "additionalProperties", "patternProperties", "minProperties",
               "maxProperties", "propertyNames", "dependentRequired", "dependentSchemas", "dependencies",
               "unevaluatedProperties"},
}
COMBINATORS = ("anyOf", "oneOf", "allOf")
OLD_DIALECTS = ("draft-03", "draft-04", "draft-06", "draft-07")


class UnsupportedKeywordError(RefusedError):
    """A valid schema with a keyword the backend would not enforce: which, and where."""

    def __reduce__(self):  # pickled whole: a compile worker sends it to the server process
        return type(self), (str(self), self.keyword, self.path)

    def __init__(self, message: str, keyword: str, path: str) -> None:
        super().__init__(message)
        self.keyword, self.path = keyword, path


@dataclass(frozen=True)
class SchemaRules:
    """What a regex / grammar-converting backend (xgrammar, outlines) enforces exactly."""

    backend: str
    unenforced: frozenset[str]  # keywords it accepts and ignores (or approximates)
    formats: frozenset[str]  # the formats it enforces exactly
    regex_features: frozenset[str] = frozenset()  # grammar/schema/regex_features.py names it enforces exactly


# The formats JSON Schema defines; any other is refused by every backend alike (strict), or
# dropped and listed (strict: false).
FORMATS = frozenset({"date-time", "date", "time", "duration", "email", "idn-email", "hostname", "idn-hostname",
                     "ipv4", "ipv6", "uri", "uri-reference", "iri", "iri-reference", "uuid", "uri-template",
                     "json-pointer", "relative-json-pointer", "regex"})


# Found by the oracle: xgrammar 0.2.9 and outlines-core 0.2 ignore these, or enforce them as
# something looser (oneOf as anyOf, allOf with several schemas only approximately).
BASE_UNENFORCED = frozenset({
    "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies", "uniqueItems",
    "multipleOf", "patternProperties", "propertyNames", "contains", "minContains", "maxContains",
    "unevaluatedProperties", "unevaluatedItems", "minProperties", "maxProperties", "$dynamicRef",
    "$dynamicAnchor", "$recursiveRef", "$recursiveAnchor", "$anchor"})


def _refuse(keyword: str, path: str, why: str = "it would be ignored", backend: str = "xgrammar") -> GrammarError:
    return UnsupportedKeywordError(f"json schema keyword {keyword!r} at {path} is not supported by the {backend} "
                                   f"grammar backend ({why}, so the request is refused)", keyword, path)


def subschemas(schema, path: str = "#"):
    """(subschema, path) for each schema directly inside `schema`."""
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        if key in SUBSCHEMA and isinstance(value, (dict, bool)):
            yield value, f"{path}/{key}"
        elif key in SUBSCHEMA and isinstance(value, list):  # draft-4 tuple items
            yield from ((sub, f"{path}/{key}/{i}") for i, sub in enumerate(value))
        elif key in SUBSCHEMA_MAPS and isinstance(value, dict):
            yield from ((sub, f"{path}/{key}/{name}") for name, sub in value.items())
        elif key in SUBSCHEMA_LISTS and isinstance(value, list):
            yield from ((sub, f"{path}/{key}/{i}") for i, sub in enumerate(value))


def find_keyword(schema, keyword: str, path: str = "#") -> str | None:
    """The path of the first schema that uses `keyword`, without recursion."""
    stack = [(schema, path)]
    while stack:
        node, where = stack.pop()
        if isinstance(node, dict) and keyword in node:
            return where
        stack.extend(reversed(list(subschemas(node, where))))
    return None


def relaxed(schema, keyword: str, path: str):
    """`schema` without `keyword` at `path` (a `oneOf` becomes an `anyOf`, which it implies),
    for non-strict requests; None when there is nothing there to drop."""
    schema = copy.deepcopy(schema)
    stack = [(schema, "#")]
    while stack:
        node, where = stack.pop()
        if where == path and isinstance(node, dict):
            names = {"minLength/maxLength": ("minLength", "maxLength")}.get(keyword, (keyword.split(":")[0],))
            if not any(name in node for name in names):
                return None
            if names == ("oneOf",) and "anyOf" not in node:
                node["anyOf"] = node.pop("oneOf")
            for name in names:
                node.pop(name, None)
            return schema
        stack.extend(subschemas(node, where))
    return None


def _kind(keyword: str) -> str | None:
    return next((kind for kind, words in KIND_KEYWORDS.items() if keyword in words), None)


def check_schema(schema, rules: SchemaRules) -> None:
    """Raise UnsupportedKeywordError for the first keyword, `format` value or regex feature the
    backend would not enforce exactly."""
    check_formats(schema, rules.formats, rules.backend)
    check_patterns(schema, rules.regex_features, rules.backend)
    _check_keywords(schema, rules)


def _check_keywords(schema, rules: SchemaRules, path: str = "#") -> None:
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise GrammarError(f"json schema at {path} must be an object or a boolean")
    refuse = lambda keyword, why="it would be ignored": _refuse(keyword, path, why, rules.backend)  # noqa: E731
    for key in schema:
        if key in rules.unenforced:
            raise refuse(key)
    if "$id" in schema and path != "#":
        raise refuse("$id", "a nested base URI is not resolved")
    ref = schema.get("$ref")
    if ref is not None and not (isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))):
        raise refuse("$ref", f"only local JSON pointers ('#/...') are resolved, not {str(ref)[:80]!r}")
    constraining = [k for k in schema if k not in ANNOTATIONS]
    if ref is not None and len(constraining) > 1:
        raise refuse("$ref", f"its sibling keywords {sorted(set(constraining) - {'$ref'})} would be dropped")
    combinators = [k for k in COMBINATORS if k in schema]
    if combinators and len(constraining) > 1:
        raise refuse(combinators[0], f"its sibling keywords {sorted(set(constraining) - {combinators[0]})} "
                                     f"would be dropped")
    if "allOf" in schema and len(schema["allOf"]) > 1:
        raise refuse("allOf", "with several schemas it is not enforced exactly")
    if "oneOf" in schema and len(schema["oneOf"]) > 1:
        raise refuse("oneOf", "it is enforced as anyOf")
    if "pattern" in schema and ("minLength" in schema or "maxLength" in schema):
        raise refuse("minLength/maxLength", "beside a pattern they would be ignored")
    if isinstance(schema.get("prefixItems"), list) and schema.get("minItems", 0) < len(schema["prefixItems"]):
        raise refuse("prefixItems", "shorter arrays would be refused: give minItems >= the number of prefixItems")
    declared = schema.get("type")
    for key in schema:
        kind = _kind(key)
        if kind is not None and not (declared == kind or (kind == "number" and declared == "integer")):
            raise refuse(key, f"it is enforced only with \"type\": \"{kind}\" beside it (a JSON Schema applies "
                              f"it to {kind}s alone and lets other values through)")
    for sub, where in subschemas(schema, path):
        _check_keywords(sub, rules, where)


def check_formats(schema, enforced: frozenset[str], backend: str) -> None:
    """Refuse the first `format` that is unknown (the same words from every backend), or that
    `backend` does not enforce exactly."""
    for node, path in walk(schema):
        fmt = node.get("format")
        if not isinstance(fmt, str) or fmt in enforced:
            continue
        if fmt not in FORMATS:
            raise UnsupportedKeywordError(f"json schema keyword 'format: {fmt}' at {path} is an unknown format (JSON "
                                          f"Schema defines no such format, so no grammar backend enforces it, and "
                                          f"the request is refused)", f"format: {fmt}", path)
        raise _refuse(f"format: {fmt}", path, "it has no exact grammar for this format", backend)


def check_patterns(schema, enforced: frozenset[str], backend: str) -> None:
    """Refuse the first `pattern` (or `patternProperties` name) using a regex feature that
    `backend` does not enforce exactly (grammar/schema/regex_features.py)."""
    for node, path in walk(schema):
        patterns = [("pattern", node["pattern"])] if isinstance(node.get("pattern"), str) else []
        if isinstance(node.get("patternProperties"), dict):
            patterns += [("patternProperties", name) for name in node["patternProperties"]]
        for keyword, pattern in patterns:
            found = regex_features.unenforced(pattern, enforced)
            if found is not None:
                raise _refuse(keyword, path, f"it uses a {found[0]} ({found[1]!r}), which this backend would not "
                                             f"enforce exactly", backend)


def check_regex(pattern: str, enforced: frozenset[str], backend: str) -> None:
    """The same rule for a `regex` spec."""
    found = regex_features.unenforced(pattern, enforced)
    if found is not None:
        raise RefusedError(f"regex uses a {found[0]} ({found[1]!r}), which the {backend} grammar backend would not "
                           f"enforce exactly, so the request is refused")


def walk(schema, path: str = "#"):
    """(schema, path) for every schema object in `schema`, itself first, without recursion."""
    stack = [(schema, path)]
    while stack:
        node, where = stack.pop()
        if isinstance(node, dict):
            yield node, where
            stack.extend(reversed(list(subschemas(node, where))))


def check_metaschema(schema, what: str = "json schema") -> None:
    """GrammarError naming the path of the first keyword whose value the schema's own draft
    forbids (`minLength: "5"`, `maxLength: -3`, `multipleOf: -1`)."""
    import jsonschema  # here, not at import: the engine must import where only torch and transformers are

    cls = jsonschema.validators.validator_for(schema)
    try:
        cls.check_schema(schema, format_checker=None)  # `format: regex` is not asserted: ECMA syntax is not Python's
    except jsonschema.exceptions.SchemaError as exc:
        where = "#" + "".join(f"/{part}" for part in exc.path)
        raise GrammarError(f"{what} is invalid at {where}: {exc.message}") from None


def normalize(schema, deep: bool = True):
    """Exact rewrites before compiling: under draft 7 and older, `$ref` replaces its siblings;
    `not`, `oneOf`, conditionals and dependencies become keywords backends enforce
    (grammar/schema/rewrite.py; not `deep`: only a provably disjoint `oneOf` becomes an `anyOf`)."""
    if not isinstance(schema, dict):
        return rewrite(schema, deep=deep)
    old = any(d in str(schema.get("$schema", "")) for d in OLD_DIALECTS)
    schema = copy.deepcopy(schema)
    if old:
        _drop_ref_siblings(schema)
    hoist_refs(schema)
    return rewrite(schema, deep=deep)


def _drop_ref_siblings(schema) -> None:
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict) and "$ref" in node:
            for key in [k for k in node if k not in ("$ref", "$defs", "definitions")]:
                del node[key]
        stack.extend(sub for sub, _ in subschemas(node))
