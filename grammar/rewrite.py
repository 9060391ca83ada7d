"""Exact rewrites of JSON Schema keywords no backend enforces into ones they do: `not` (pushed
inward until it disappears), `if` / `then` / `else`, `dependencies`, `dependentRequired`,
`dependentSchemas`. Each rewrite accepts exactly the values the original accepts; where no
exact rewrite exists (`not` over `pattern`, `multipleOf`, `format`, `uniqueItems`, ...) the
keyword is left as it is, for the backend to refuse by name. The oracle
(tests/grammar/test_oracle.py) checks the results against the JSON-Schema-Test-Suite.

Keywords that apply to one kind of value negate within that kind: a string satisfies
`{"minimum": 5}`, so `not {"minimum": 5}` is `{"type": "number", "exclusiveMaximum": 5}`.
"""

from __future__ import annotations

import copy
import json
import math
import threading
from urllib.parse import unquote

TYPES = ("null", "boolean", "object", "array", "number", "string")
ANNOTATIONS = {"$schema", "$id", "$comment", "title", "description", "default", "examples", "$defs", "definitions",
               "deprecated", "readOnly", "writeOnly", "contentMediaType", "contentEncoding", "contentSchema"}
MAX_REF_DEPTH = 16
MAX_STEPS = 20_000  # schema nodes a rewrite may visit or build
MAX_COMPLEMENT_CHARS = 4096  # strings an `enum` negation may exclude, in all
COUNTS = {"minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties", "minContains",
          "maxContains"}


class _Inexpressible(Exception):
    """No exact rewrite without `not`."""


class _TooBig(Exception):
    """The rewrite would grow past MAX_STEPS (negations of nested oneOf multiply)."""


_budget = threading.local()


def _spend() -> None:
    _budget.left = getattr(_budget, "left", MAX_STEPS) - 1
    if _budget.left < 0:
        raise _TooBig


def rewrite(schema, root=None, depth: int = 0, deep: bool = True):
    """`schema` with `not`, `oneOf`, conditionals and dependencies rewritten where that is
    exact (a new object; the input is left alone). Not `deep`: only a provably disjoint `oneOf`
    becomes an `anyOf` (for backends that refuse `allOf` beside other keywords anyway). A deep
    rewrite that would take more than MAX_STEPS steps (a hostile nesting of `oneOf` and `not`)
    falls back to the light one: what it left is then refused by name."""
    if root is None:
        _budget.left = MAX_STEPS if deep else math.inf  # the light rewrite only copies
        try:
            return _rewrite({} if schema is True else schema, schema, depth, deep)
        except (_TooBig, RecursionError):  # RecursionError: `$ref` chains negated through each other
            _budget.left = math.inf
            return _rewrite({} if schema is True else schema, schema, depth, False)
    return _rewrite(schema, root, depth, deep)


def _rewrite(schema, root, depth: int, deep: bool):
    _spend()
    if isinstance(schema, list):
        return [rewrite(s, root, depth, deep) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in COUNTS and isinstance(value, float) and value.is_integer():
            out[key] = int(value)  # 2.0 is the count 2; some backends want an integer
        elif key in ("const", "enum", "default", "examples") or not isinstance(value, (dict, list)):
            out[key] = value
        elif key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
            out[key] = {k: rewrite(v, root, depth, deep) for k, v in value.items()} if isinstance(value, dict) \
                else value
        else:
            out[key] = rewrite(value, root, depth, deep)
    if not deep:
        if isinstance(out.get("oneOf"), list) and "anyOf" not in out and disjoint(out["oneOf"]):
            out["anyOf"] = out.pop("oneOf")
        return out
    extra = []
    if "not" in out:
        try:
            extra.append(negate(out["not"], root, depth))
            del out["not"]
        except _Inexpressible:
            pass
    if "if" in out:
        try:
            extra.append(_conditional(out, root, depth))
            for key in ("if", "then", "else"):
                out.pop(key, None)
        except _Inexpressible:
            pass
    if isinstance(out.get("oneOf"), list) and "anyOf" not in out:
        try:
            out["anyOf"] = _exactly_one(out["oneOf"], root, depth)
            del out["oneOf"]
        except _Inexpressible:
            pass
    for key in ("dependentRequired", "dependentSchemas", "dependencies"):
        if isinstance(out.get(key), dict):
            extra.extend(_dependency(name, need) for name, need in out.pop(key).items())
    if extra:
        out["allOf"] = list(out.get("allOf", [])) + extra
    return out


def _exactly_one(branches: list, root, depth: int) -> list:
    """oneOf as anyOf branches: each branch, and the negation of every branch that could
    overlap with it (none needed where the branches are provably disjoint)."""
    if not branches:
        raise _Inexpressible  # oneOf [] accepts nothing; leave it to the backend
    out = []
    for i, branch in enumerate(branches):
        others = [negate(b, root, depth) for j, b in enumerate(branches)
                  if j != i and not disjoint([branch, b])]
        out.append(_all([branch, *others]))
    return out


def _conditional(node: dict, root, depth: int):
    """if I then T else E  ==  (I and T) or (not I and E)."""
    condition = node["if"]
    then, otherwise = node.get("then", True), node.get("else", True)
    return _any([_all([condition, then]), _all([negate(condition, root, depth), otherwise])])


def _dependency(name: str, need):
    """An object with `name` must also meet `need` (a list of keys or a schema)."""
    absent = {"properties": {name: False}}
    if isinstance(need, list):
        return {"anyOf": [absent, {"required": [name, *need]}]}
    return {"anyOf": [absent, {"required": [name], "allOf": [need]}]}


def negate(schema, root, depth: int = 0):
    """A schema accepting exactly the values `schema` rejects; _Inexpressible if none can be
    written without `not`."""
    _spend()
    if schema is True or schema == {}:
        return False
    if schema is False:
        return True
    if not isinstance(schema, dict):
        raise _Inexpressible
    keys = {k for k in schema if k not in ANNOTATIONS}
    if not keys:
        return False
    parts = []
    done: set[str] = set()
    for key in sorted(keys):
        if key in done:
            continue
        branch, used = _negate_keyword(key, schema, root, depth)
        done |= used
        parts.append(branch)
    return _any(parts)


def _negate_keyword(key: str, s: dict, root, depth: int):
    """(the values `s`'s keyword `key` rejects, the keywords that covered)."""
    v = s[key]
    if key == "not":
        return rewrite(v, root, depth), {key}
    if key == "$ref":
        return negate(_resolve(v, root, depth), root, depth + 1), {key}
    if key == "type":
        return _not_types(v), {key}
    if key in ("enum", "const"):
        return _not_values(v if key == "enum" else [v]), {key}
    if key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        if isinstance(v, bool) or isinstance(s.get("exclusiveMinimum"), bool) or \
                isinstance(s.get("exclusiveMaximum"), bool):  # draft-4 flags change minimum / maximum
            raise _Inexpressible
        flipped = {"minimum": "exclusiveMaximum", "maximum": "exclusiveMinimum",
                   "exclusiveMinimum": "maximum", "exclusiveMaximum": "minimum"}[key]
        return {"type": "number", flipped: v}, {key}
    if key in ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties"):
        return _not_count(key, v), {key}
    if key == "required":
        return _any([{"type": "object", "properties": {name: False}} for name in v]), {key}
    if key in ("properties", "additionalProperties", "patternProperties"):
        return _not_properties(s, root, depth), {"properties", "additionalProperties", "patternProperties"}
    if key in ("items", "prefixItems", "additionalItems"):
        return _not_items(s, root, depth), {"items", "prefixItems", "additionalItems"}
    if key in ("contains", "minContains", "maxContains"):
        if "minContains" in s or "maxContains" in s or "contains" not in s:
            raise _Inexpressible
        return {"type": "array", "items": negate(s["contains"], root, depth)}, {"contains"}
    if key == "allOf":
        return _any([negate(b, root, depth) for b in v]), {key}
    if key == "anyOf":
        return _all([negate(b, root, depth) for b in v]), {key}
    if key == "oneOf":  # none, or two at once
        pairs = [_all([a, b]) for i, a in enumerate(v) for b in v[i + 1:]]
        return _any([_all([negate(b, root, depth) for b in v]), *pairs]), {key}
    if key in ("if", "then", "else"):
        if "if" not in s:
            return False, {"then", "else"}  # without `if` they constrain nothing
        return negate(_conditional(s, root, depth), root, depth), {"if", "then", "else"}
    if key in ("dependentRequired", "dependentSchemas", "dependencies"):
        return _any([negate(_dependency(n, need), root, depth) for n, need in v.items()]), {key}
    if key == "uniqueItems" and v is False:
        return False, {key}
    raise _Inexpressible  # pattern, format, multipleOf, uniqueItems, propertyNames, unevaluated*, $dynamicRef, ...


def _not_types(declared) -> dict:
    names = {declared} if isinstance(declared, str) else set(declared)
    if "integer" in names and "number" not in names:
        raise _Inexpressible  # a number with a fraction has no type of its own
    rest = [t for t in TYPES if t not in names and not (t == "number" and "integer" in names)]
    return {"type": rest} if rest else False


def _not_values(values: list):
    """Every value except these."""
    by_type: dict[str, list] = {}
    for value in values:
        by_type.setdefault(_type_of(value), []).append(value)
    if "object" in by_type or "array" in by_type:
        raise _Inexpressible
    parts = [{"type": [t for t in TYPES if t not in by_type]}] if len(by_type) < len(TYPES) else []
    if "boolean" in by_type and len(set(by_type["boolean"])) == 1:
        parts.append({"const": not by_type["boolean"][0]})
    if "number" in by_type:
        bounds = sorted(set(by_type["number"]))
        parts.append({"type": "number", "exclusiveMaximum": bounds[0]})
        parts += [{"type": "number", "exclusiveMinimum": a, "exclusiveMaximum": b} for a, b in zip(bounds, bounds[1:])]
        parts.append({"type": "number", "exclusiveMinimum": bounds[-1]})
    if "string" in by_type:
        parts.append({"type": "string", "pattern": "^(?:" + _complement(by_type["string"]) + ")$"})
    return _any(parts)


def _type_of(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}[type(value)]


def _not_count(key: str, n):
    if not isinstance(n, (int, float)) or isinstance(n, bool):
        raise _Inexpressible
    kind = {"Length": "string", "Items": "array", "Properties": "object"}[key[3:]]
    if not float(n).is_integer():
        raise _Inexpressible  # not a valid count; leave it to the backend to refuse
    n = int(n)
    if key.startswith("min"):
        return {"type": kind, "max" + key[3:]: n - 1} if n >= 1 else False
    return {"type": kind, "min" + key[3:]: n + 1}


def _not_properties(s: dict, root, depth: int):
    """An object with a named property that breaks its schema (extra keys: inexpressible)."""
    if s.get("patternProperties") or s.get("additionalProperties", True) is not True:
        if "patternProperties" not in s and s.get("additionalProperties") is False and not s.get("properties"):
            return {"type": "object", "minProperties": 1}
        raise _Inexpressible
    return _any([{"type": "object", "required": [name], "properties": {name: negate(sub, root, depth)}}
                 for name, sub in s.get("properties", {}).items()])


def _not_items(s: dict, root, depth: int):
    """An array with an item at a position that breaks its schema."""
    prefix = s.get("prefixItems")
    items = s.get("items")
    if prefix is None and isinstance(items, list):  # draft 7 tuple form
        prefix, items = items, s.get("additionalItems", True)
    elif "additionalItems" in s:
        raise _Inexpressible  # draft 7: additionalItems is ignored unless items is a list
    parts = []
    for i, sub in enumerate(prefix or []):
        position = {"type": "array", "minItems": i + 1, "prefixItems": [True] * i + [negate(sub, root, depth)]}
        parts.append(position)
    rest = True if items is None else items
    if rest is False:
        parts.append({"type": "array", "minItems": len(prefix or []) + 1})
    elif rest is not True and rest != {}:
        raise _Inexpressible  # "some later item breaks it" needs `contains`
    return _any(parts)


def _any(parts: list):
    parts = [p for p in parts if p is not False]
    if any(p is True for p in parts):
        return True
    if not parts:
        return False
    return parts[0] if len(parts) == 1 else {"anyOf": parts}


def _all(parts: list):
    if any(p is False for p in parts):
        return False
    parts = [p for p in parts if p is not True]
    if not parts:
        return True
    return parts[0] if len(parts) == 1 else {"allOf": parts}


def _resolve(ref, root, depth: int):
    if depth >= MAX_REF_DEPTH or root is None:
        raise _Inexpressible
    try:
        return resolve_pointer(ref, root)
    except LookupError:
        raise _Inexpressible from None


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


MOVED = {"not", "oneOf", "if", "then", "else", "dependencies", "dependentSchemas"}  # what rewrite() restructures


def hoist_refs(schema: dict) -> None:
    """In place: a `$ref` into a part that rewrite() restructures points at a copy of its
    target under `$defs` instead (the pointer would not survive the rewrite)."""
    names: dict[str, str] = {}
    work = [schema]
    while work:
        node = work.pop()
        if isinstance(node, list):
            work.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/") and MOVED & set(pointer_parts(ref)):
            if ref not in names:
                try:
                    target = copy.deepcopy(resolve_pointer(ref, schema))
                except LookupError:
                    target = None
                if target is not None:
                    names[ref] = f"loraplex_ref{len(names)}"
                    schema.setdefault("$defs", {})[names[ref]] = target
                    work.append(target)
            if ref in names:
                node["$ref"] = f"#/$defs/{names[ref]}"
        work.extend(v for k, v in node.items() if k not in ("const", "enum", "default", "examples"))


def _complement(strings: list[str]) -> str:
    """A regex (ECMAScript / Rust syntax) for every string except these."""
    if sum(len(text) for text in strings) > MAX_COMPLEMENT_CHARS:
        raise _Inexpressible
    trie: dict = {}
    for text in set(strings):
        node = trie
        for char in text:
            node = node.setdefault(char, {})
        node[""] = {}  # end marker
    return _complement_at(trie)


def _complement_at(node: dict) -> str:
    anything = r"[\s\S]*"
    children = sorted(k for k in node if k)
    options = [] if "" in node else [""]  # the prefix itself, when it is not one of the strings
    other = "".join(_class_char(c) for c in children)
    options.append((f"[^{other}]" if other else r"[\s\S]") + anything)
    options += [_escape(c) + "(?:" + _complement_at(node[c]) + ")" for c in children]
    return "|".join(options)


def _class_char(char: str) -> str:
    return "\\" + char if char in "\\]^-[" else char


def _escape(char: str) -> str:
    return "\\" + char if char in r"\^$.|?*+()[]{}/" else char


def _types(branch) -> set[str] | None:
    """The JSON types a branch admits, when it says (None: any)."""
    if not isinstance(branch, dict):
        return None if branch is True else set()
    if "const" in branch:
        return {_type_of(branch["const"])}
    if isinstance(branch.get("enum"), list):
        return {_type_of(v) for v in branch["enum"]}
    declared = branch.get("type")
    if declared is None:
        return None
    names = {declared} if isinstance(declared, str) else set(declared)
    return {"number" if name == "integer" else name for name in names}


def _values(branch, key: str):
    """The values a branch allows for property `key` (a const / enum that it requires), else None."""
    if not isinstance(branch, dict) or key not in branch.get("required", []):
        return None
    prop = branch.get("properties", {}).get(key)
    if isinstance(prop, dict) and "const" in prop:
        return [prop["const"]]
    if isinstance(prop, dict) and isinstance(prop.get("enum"), list):
        return prop["enum"]
    return None


def _closed_keys(branch) -> tuple[set[str], set[str]] | None:
    """(required, allowed) property names of a closed object branch, else None."""
    if not isinstance(branch, dict) or branch.get("additionalProperties") is not False or "patternProperties" in branch:
        return None
    return set(branch.get("required", [])), set(branch.get("properties", {}))


def disjoint(branches: list) -> bool:
    """Can no JSON value satisfy two of these branches? Proved by different types, by a
    required property whose const / enum values differ, or by closed objects each requiring a
    key the other does not allow. False when unsure."""
    if len(branches) < 2 or not all(isinstance(b, dict) for b in branches):
        return len(branches) < 2
    for i, a in enumerate(branches):
        for b in branches[i + 1:]:
            if not _pair_disjoint(a, b):
                return False
    return True


def _pair_disjoint(a: dict, b: dict) -> bool:
    ta, tb = _types(a), _types(b)
    if ta is not None and tb is not None and not ta & tb:
        return True
    objects = (ta is None or ta == {"object"}) and (tb is None or tb == {"object"})
    if not objects or ta is None and tb is None:
        return False
    for key in set(a.get("required", [])) & set(b.get("required", [])):
        va, vb = _values(a, key), _values(b, key)
        if va is not None and vb is not None and not _any_equal(va, vb):
            return True
    ka, kb = _closed_keys(a), _closed_keys(b)
    if ka is not None and kb is not None:
        (required_a, allowed_a), (required_b, allowed_b) = ka, kb
        return bool(required_a - allowed_b) or bool(required_b - allowed_a)
    return False


def _any_equal(xs: list, ys: list) -> bool:
    canon = lambda v: json.dumps(v, sort_keys=True)  # noqa: E731  1 and 1.0 aside, JSON equality
    return bool({canon(x) for x in xs} & {canon(y) for y in ys}) or any(
        isinstance(x, (int, float)) and not isinstance(x, bool) and x == y for x in xs for y in ys)
