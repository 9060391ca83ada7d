"""Values a schema admits, read without a validator: the few values a schema provably admits
(`finite_values`), whether a schema admits one value (`admits`: True, False, or None when
unsure), JSON equality (`canon`), and the dialect and pointer helpers these readings and the
rewrites share (`dialect`, `resolve_pointer`, `follow_refs`, `tuple_keywords`).
"""

from __future__ import annotations

import functools
import json
import math
from urllib.parse import unquote

from loraplex.grammar.schema.ecma_regex import ecma_search
from loraplex.grammar.schema.rewrite_state import budget, memo

TYPES = ("null", "boolean", "object", "array", "number", "string")
ANNOTATIONS = {"$schema", "$id", "$comment", "title", "description", "default", "examples", "$defs", "definitions",
               "deprecated", "readOnly", "writeOnly", "contentMediaType", "contentEncoding", "contentSchema"}
MAX_REF_DEPTH = 16
MAX_FINITE = 256  # values a schema may admit and still count as a finite set here


def type_of(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}[type(value)]


def pointer_parts(ref: str) -> list[str]:
    return [unquote(p).replace("~1", "/").replace("~0", "~") for p in ref[2:].split("/")] if ref != "#" else []


def resolve_pointer(ref, root):
    """The schema a local `$ref` ("#" or "#/a/b") names; LookupError if none."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        raise LookupError(ref)
    node = root
    for part in pointer_parts(ref):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise LookupError(ref)
    return node


def dialect(root) -> int:
    """The root's dialect as a sortable number (the newest when `$schema` names none)."""
    return _draft_of(str(root.get("$schema", "")) if isinstance(root, dict) else "")


@functools.lru_cache(maxsize=64)
def _draft_of(uri: str) -> int:
    for tag, number in (("draft-03", 3), ("draft-04", 4), ("draft-06", 6), ("draft-07", 7), ("2019-09", 2019)):
        if tag in uri:
            return number
    return 2020


def tuple_keywords(positions: list, rest, root) -> dict:
    """Array keywords for these positions, then `rest` for every later item, in the root's dialect."""
    if dialect(root) < 2020:
        return {"items": positions, **({} if rest is True else {"additionalItems": rest})}
    return {"prefixItems": positions, **({} if rest is True else {"items": rest})}


def trivial(schema) -> bool:
    """Does `schema` admit every value (true, or annotations only)?"""
    return schema is True or isinstance(schema, dict) and all(k in ANNOTATIONS for k in schema)


def follow_refs(schema, root, depth: int = 0):
    """`schema`, or what a bare local `$ref` chain leads to."""
    while isinstance(schema, dict) and set(schema) - ANNOTATIONS == {"$ref"} and depth < MAX_REF_DEPTH:
        try:
            schema = resolve_pointer(schema["$ref"], root)
        except LookupError:
            break
        depth += 1
    return schema


# ---- values: a few values a schema admits, and whether a schema admits a value ----

def _integral(value):
    """`value` with every integral float as an integer: JSON Schema compares numbers by value."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integral(v) for v in value]
    if isinstance(value, dict):
        return {k: _integral(v) for k, v in value.items()}
    return value


def integral(value):
    """`value` with each integral float (below 2**63) as an integer: the same JSON Schema value, in the
    form a grammar should write it (outlines writes an `enum`'s 1.0 as `1.0` and takes no `1`)."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer() and abs(value) < 2 ** 63:
        return int(value)
    if isinstance(value, list):
        return [integral(v) for v in value]
    if isinstance(value, dict):
        return {k: integral(v) for k, v in value.items()}
    return value


def canon(value) -> str:
    """The same text for values JSON Schema calls equal (`1` and `1.0`, any key order)."""
    return json.dumps(_integral(value), sort_keys=True)


def canon_set(values: list) -> frozenset[str]:
    return memo("enum", values, lambda: frozenset(canon(v) for v in values))


def distinct(values: list) -> list:
    seen: dict[str, object] = {}
    for value in values:
        seen.setdefault(canon(value), value)
    return list(seen.values())


def finite_values(schema, root, depth: int = 0) -> list | None:
    """The values `schema` admits, when it provably admits only a few (distinct as JSON); None
    when it may admit more, or when this cannot tell."""
    if depth == 0 and isinstance(schema, dict):
        return memo("finite", schema, lambda: _read_finite(schema, root, 0))
    return _read_finite(schema, root, depth)


def _read_finite(schema, root, depth: int) -> list | None:
    if schema is False:
        return []
    if not isinstance(schema, dict) or depth > MAX_REF_DEPTH:
        return None
    candidates = _candidates(schema, root, depth)
    if candidates is None or len(candidates) > MAX_FINITE:
        return None
    verdicts = [admits(schema, value, root, depth) for value in candidates]
    if None in verdicts:
        return None
    return [value for value, ok in zip(candidates, verdicts) if ok]


def _candidates(schema: dict, root, depth: int) -> list | None:
    """Values among which are all that `schema` admits (its own verdict filters them)."""
    if "$ref" in schema and dialect(root) <= 7:
        schema = {"$ref": schema["$ref"]}  # its siblings are ignored
    if "const" in schema and dialect(root) >= 6:
        return [schema["const"]]
    if isinstance(schema.get("enum"), list):
        return distinct(schema["enum"])
    declared = schema.get("type")
    names = {declared} if isinstance(declared, str) else set(declared) if isinstance(declared, list) else None
    if names and all(isinstance(n, str) for n in names) and names <= {"boolean", "null"}:
        return [v for v in (True, False, None) if type_of(v) in names]
    if "$ref" in schema:
        try:
            return finite_values(resolve_pointer(schema["$ref"], root), root, depth + 1)
        except LookupError:
            return None
    for member in schema.get("allOf", []) if isinstance(schema.get("allOf"), list) else []:
        values = finite_values(member, root, depth + 1)
        if values is not None:
            return values
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            parts = [finite_values(member, root, depth + 1) for member in schema[key]]
            if all(part is not None for part in parts):
                return distinct([v for part in parts for v in part])
    return None


# Keywords with a meaning (any other is an unknown keyword, which constrains nothing).
KEYWORDS = frozenset({
    "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum", "maxLength",
    "minLength", "pattern", "format", "items", "additionalItems", "prefixItems", "maxItems", "minItems", "uniqueItems",
    "contains", "maxContains", "minContains", "maxProperties", "minProperties", "required", "properties",
    "patternProperties", "additionalProperties", "dependencies", "dependentRequired", "dependentSchemas",
    "propertyNames", "allOf", "anyOf", "oneOf", "not", "if", "then", "else", "$ref", "$dynamicRef", "$recursiveRef",
    "unevaluatedItems", "unevaluatedProperties", "divisibleBy", "disallow", "extends"})
# The draft that brought each newer keyword: in an older one it is unknown.
SINCE = {"const": 6, "contains": 6, "propertyNames": 6, "if": 7, "then": 7, "else": 7, "dependentRequired": 2019,
         "dependentSchemas": 2019, "minContains": 2019, "maxContains": 2019, "unevaluatedItems": 2019,
         "unevaluatedProperties": 2019, "$recursiveRef": 2019, "prefixItems": 2020, "$dynamicRef": 2020}
KINDS = {"string": ("minLength", "maxLength", "pattern"),
         "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
         "array": ("items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems", "contains",
                   "minContains", "maxContains", "unevaluatedItems"),
         "object": ("properties", "required", "additionalProperties", "patternProperties", "minProperties",
                    "maxProperties", "propertyNames", "dependentRequired", "dependentSchemas", "dependencies",
                    "unevaluatedProperties")}
KIND_OF = {key: kind for kind, keys in KINDS.items() for key in keys}
TESTED = {"type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
          "maxLength", "minLength", "items", "prefixItems", "additionalItems", "maxItems", "minItems", "uniqueItems",
          "maxProperties", "minProperties", "required", "properties", "patternProperties", "additionalProperties",
          "propertyNames", "allOf", "anyOf", "oneOf", "not", "if", "then", "else", "$ref", "dependencies",
          "dependentRequired", "dependentSchemas"}


UNTIL = {"dependencies": 2019}  # split into dependentRequired / dependentSchemas in 2019-09: no keyword since


def known(key: str, root) -> bool:
    """Is `key` a keyword in the root's dialect?"""
    return key in KEYWORDS and SINCE.get(key, 0) <= dialect(root) < UNTIL.get(key, math.inf)


def admits(schema, value, root, depth: int = 0) -> bool | None:
    """Does `schema` admit `value`? None when it uses a keyword this does not evaluate (a
    `pattern`, a `format`, ...) and no other keyword rejects the value."""
    if isinstance(schema, bool):
        return schema
    budget.verdicts = getattr(budget, "verdicts", math.inf) - 1
    if budget.verdicts < 0:
        return None
    if not isinstance(schema, dict) or depth > MAX_REF_DEPTH or dialect(root) <= 3:
        return None  # the oldest draft's `required` sits on the property: not read here
    keys = [k for k in schema if known(k, root)]
    if "$ref" in schema and dialect(root) <= 7:
        keys = ["$ref"]  # its siblings are ignored
    verdicts = []
    for key in keys:
        verdict = _keyword_verdict(key, schema, value, root, depth)
        if verdict is False:
            return False  # keywords constrain together: one rejection is final
        verdicts.append(verdict)
    return None if None in verdicts else True


def _keyword_verdict(key: str, s: dict, value, root, depth: int) -> bool | None:
    kind = KIND_OF.get(key)
    if kind is not None and type_of(value) != kind:
        return True  # a keyword for another kind of value lets this one through
    if key not in TESTED:
        return None
    v = s[key]
    if key == "type":
        return _type_verdict(v, value, dialect(root))
    if key == "enum":
        return canon(value) in canon_set(v) if isinstance(v, list) else None
    if key == "const":
        return canon(value) == canon(v)
    if key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"):
        return _number_verdict(key, s, value)
    if key in ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties"):
        return _count_verdict(key, v, len(value))
    if key == "uniqueItems":
        return v is not True or len({canon(x) for x in value}) == len(value)
    if key in ("items", "prefixItems", "additionalItems"):
        return _items_verdict(s, value, root, depth)
    if key == "required":
        return all(name in value for name in v) if isinstance(v, list) else None
    if key in ("properties", "patternProperties", "additionalProperties"):
        return _properties_verdict(s, value, root, depth)
    if key == "propertyNames":
        return _all_verdicts(admits(v, name, root, depth + 1) for name in value)
    if key in ("dependencies", "dependentRequired", "dependentSchemas"):
        if not known(key, root):
            return None  # not a keyword in this dialect: unsure, so nothing is proven from it
        return _dependencies_verdict(v, value, root, depth)
    if key == "$ref":
        try:
            return admits(resolve_pointer(v, root), value, root, depth + 1)
        except LookupError:
            return None
    return _logic_verdict(key, s, value, root, depth)


def _logic_verdict(key: str, s: dict, value, root, depth: int) -> bool | None:
    v = s[key]
    if key in ("then", "else"):
        return True  # read with `if`
    if key == "if":
        condition = admits(v, value, root, depth + 1)
        branch = s.get("then", True) if condition else s.get("else", True)
        return None if condition is None else admits(branch, value, root, depth + 1)
    if key == "not":
        verdict = admits(v, value, root, depth + 1)
        return None if verdict is None else not verdict
    if not isinstance(v, list):
        return None
    verdicts = [admits(member, value, root, depth + 1) for member in v]
    if key == "allOf":
        return _all_verdicts(verdicts)
    if key == "anyOf":
        return True if True in verdicts else None if None in verdicts else False
    return None if None in verdicts else verdicts.count(True) == 1


def _all_verdicts(verdicts) -> bool | None:
    verdicts = list(verdicts)
    return False if False in verdicts else None if None in verdicts else True


def _type_verdict(declared, value, draft: int) -> bool | None:
    names = [declared] if isinstance(declared, str) else declared if isinstance(declared, list) else None
    if not names or not all(isinstance(n, str) and (n in TYPES or n == "integer") for n in names):
        return None
    kind = type_of(value)
    if kind in names:
        return True
    if kind == "number" and "integer" in names:
        if not float(value).is_integer():
            return False
        # `1` stands for `1.0` too (one value here), which is an integer only since draft 6
        return True if draft >= 6 else None
    return False


def _number_verdict(key: str, s: dict, value) -> bool | None:
    bound = s[key]
    if isinstance(bound, bool) or not isinstance(bound, (int, float)):
        return None
    if isinstance(s.get("exclusiveMinimum"), bool) or isinstance(s.get("exclusiveMaximum"), bool):
        return None  # draft-4 flags change what minimum and maximum mean
    if key == "multipleOf":
        if isinstance(value, int) and isinstance(bound, int) and bound > 0:
            return value % bound == 0
        return None  # fractions: floating point would decide
    return {"minimum": value >= bound, "maximum": value <= bound, "exclusiveMinimum": value > bound,
            "exclusiveMaximum": value < bound}[key]


def _count_verdict(key: str, bound, size: int) -> bool | None:
    if isinstance(bound, bool) or not isinstance(bound, (int, float)):
        return None
    return size >= bound if key.startswith("min") else size <= bound


def _items_verdict(s: dict, value: list, root, depth: int) -> bool | None:
    """`prefixItems` / `items` / `additionalItems` together, as the root's dialect reads them."""
    items = s.get("items", True)
    if dialect(root) < 2020:  # a tuple is an `items` list; `prefixItems` is no keyword yet
        positions, rest = (items, s.get("additionalItems", True)) if isinstance(items, list) else ([], items)
    elif isinstance(items, list):
        return None
    else:
        positions, rest = s.get("prefixItems", []), items
    if not isinstance(positions, list):
        return None
    schemas = [positions[i] if i < len(positions) else rest for i in range(len(value))]
    return _all_verdicts(admits(sub, x, root, depth + 1) for sub, x in zip(schemas, value))


def _properties_verdict(s: dict, value: dict, root, depth: int) -> bool | None:
    named, patterns = s.get("properties", {}), s.get("patternProperties", {})
    rest = s.get("additionalProperties", True)
    if not isinstance(named, dict) or not isinstance(patterns, dict):
        return None
    verdicts = []
    for key, item in value.items():
        # which patterns match a key: Python's `re` decides only where it reads them as ECMA-262 does
        matched = [(sub, ecma_search(pattern, key)) for pattern, sub in patterns.items()]
        if any(hit is None for _, hit in matched):
            return None
        rules = [sub for sub, hit in matched if hit] + ([named[key]] if key in named else [])
        verdicts += [admits(rule, item, root, depth + 1) for rule in rules or [rest]]
    return _all_verdicts(verdicts)


def _dependencies_verdict(needs, value: dict, root, depth: int) -> bool | None:
    """Each present key's dependency: the keys it needs (a list), or a schema the object meets."""
    if not isinstance(needs, dict):
        return None
    verdicts = []
    for name, need in needs.items():
        if name in value:
            verdicts.append(all(k in value for k in need) if isinstance(need, list) else
                            admits(need, value, root, depth + 1))
    return _all_verdicts(verdicts)
