"""Exact rewrites of JSON Schema keywords no backend enforces into ones they do: `not` (pushed
inward until it disappears), `if` / `then` / `else`, `dependencies`, `dependentRequired`,
`dependentSchemas`, `oneOf` (as `anyOf` where the branches are provably disjoint or their
overlaps can be cut out), `uniqueItems` over a small finite set of items (every ordered
selection of distinct items), `propertyNames` given as a set of names or a regular pattern.
Each rewrite accepts exactly the values the original accepts; where no exact rewrite exists
(`not` over `pattern`, `multipleOf`, `format`, `uniqueItems` over strings, ...) the keyword is
left as it is, for the backend to refuse by name. The oracle (tests/grammar/test_oracle.py)
checks the results against the JSON-Schema-Test-Suite.

Keywords that apply to one kind of value negate within that kind: a string satisfies
`{"minimum": 5}`, so `not {"minimum": 5}` is `{"type": "number", "exclusiveMaximum": 5}`.

What is written follows the root's dialect (`$schema`): a tuple is an `items` list before
draft 2020-12, and a single value is an `enum`, since `const` does not exist before draft 6
(llguidance reads the schema in its declared dialect and ignores keywords it lacks).
"""

from __future__ import annotations

import copy
import functools
import itertools
import json
import math
import re
import threading
import warnings
from urllib.parse import unquote

from loraplex.grammar import regex_features

TYPES = ("null", "boolean", "object", "array", "number", "string")
ANNOTATIONS = {"$schema", "$id", "$comment", "title", "description", "default", "examples", "$defs", "definitions",
               "deprecated", "readOnly", "writeOnly", "contentMediaType", "contentEncoding", "contentSchema"}
MAX_REF_DEPTH = 16
MAX_STEPS = 20_000  # schema nodes a rewrite may visit or build
MAX_COMPLEMENT_CHARS = 4096  # strings an `enum` negation may exclude, in all
COUNTS = {"minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties", "minContains",
          "maxContains"}
MAX_UNIQUE_BRANCHES = 200  # ordered selections a `uniqueItems` over a finite set may become
MAX_KEY_SUBSETS = 64  # subsets of named keys that "a key outside these" may enumerate
MAX_FINITE = 256  # values a schema may admit and still count as a finite set here
MAX_VIEWS = 8  # schemas (a branch, its `$ref` target, its `allOf` members) compared per branch
MAX_VERDICTS = 200_000  # schema-against-value checks one rewrite may make for its proofs


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
    """`schema` with `not`, `oneOf`, conditionals, dependencies, `uniqueItems` and
    `propertyNames` rewritten where that is exact (a new object; the input is left alone). Not
    `deep`: only a provably disjoint `oneOf` becomes an `anyOf` (for backends that refuse `allOf`
    beside other keywords anyway), and keywords that constrain nothing go. A deep
    rewrite that would take more than MAX_STEPS steps (a hostile nesting of `oneOf` and `not`)
    falls back to the light one: what it left is then refused by name."""
    if root is None:
        _budget.left = MAX_STEPS if deep else math.inf  # the light rewrite only copies
        _budget.memo = {}  # what was read off this schema's parts, while it (unchanged) is read
        _budget.verdicts = MAX_VERDICTS  # past it a proof is unsure: the keyword stays, refused by name
        try:
            return _rewrite({} if schema is True else schema, schema, depth, deep)
        except (_TooBig, RecursionError):  # RecursionError: `$ref` chains negated through each other
            _budget.left = math.inf
            return _rewrite({} if schema is True else schema, schema, depth, False)
        finally:
            _budget.memo, _budget.verdicts = None, math.inf
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
    if out.get("uniqueItems") is False:
        del out["uniqueItems"]  # no constraint at all
    if "propertyNames" in out and _trivial_names(_target(schema["propertyNames"], root)):
        del out["propertyNames"]
    if not deep:
        if isinstance(out.get("oneOf"), list) and "anyOf" not in out and \
                (disjoint(out["oneOf"], root) or disjoint(schema["oneOf"], root)):
            out["anyOf"] = out.pop("oneOf")
        return out
    extra = []
    if "not" in out:
        try:
            extra.append(_negate_either(schema["not"], out["not"], root, depth))
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
            out["anyOf"] = _exactly_one(list(zip(out["oneOf"], schema["oneOf"])), root, depth)
            del out["oneOf"]
        except _Inexpressible:
            pass
    if out.get("uniqueItems") is True:  # after `oneOf`, which may take the node's own `anyOf`
        try:
            _place_any(out, _unique_items(out, schema, root), extra)
        except _Inexpressible:
            pass
    if "propertyNames" in out:
        try:
            _property_names(out, schema["propertyNames"], root)
            del out["propertyNames"]
        except _Inexpressible:
            pass
    for key in ("dependentRequired", "dependentSchemas", "dependencies"):
        if isinstance(out.get(key), dict):
            extra.extend(_dependency(name, need) for name, need in out.pop(key).items())
    if extra:
        out["allOf"] = list(out.get("allOf", [])) + extra
    return out


def _place_any(out: dict, branches: list, extra: list) -> None:
    """Add the condition "one of `branches`" to the node `out`."""
    if "anyOf" in out:
        extra.append({"anyOf": branches})
    else:
        out["anyOf"] = branches


def _exactly_one(branches: list[tuple], root, depth: int) -> list:
    """oneOf as anyOf branches: each branch, and the negation of every branch that could
    overlap with it (none needed where the branches are provably disjoint). Branches that
    admit a few values each become those values that exactly one branch admits. Each branch
    comes as (rewritten, as given): either form may be the one a proof can read."""
    if not branches:
        raise _Inexpressible  # oneOf [] accepts nothing; leave it to the backend
    finite = [_finite_of(pair, root) for pair in branches]
    if all(values is not None for values in finite):
        counts: dict[str, int] = {}
        for values in finite:
            for value in values:
                counts[_canon(value)] = counts.get(_canon(value), 0) + 1
        once = [v for values in finite for v in values if counts[_canon(v)] == 1]
        return [_enum(once)]
    rewritten, given = _view_sets([b for b, _ in branches], root), _view_sets([o for _, o in branches], root)
    draft, out = _draft(root), []
    for i, pair in enumerate(branches):
        others = [other for j, other in enumerate(branches) if j != i and not (
            _sets_disjoint(rewritten[i], rewritten[j], root, draft) or _sets_disjoint(given[i], given[j], root, draft))]
        out.append(_only(pair[0], finite[i], others, root, depth))
    return [b for b in out if b is not False] or [False]


def _only(branch, values: list | None, others: list[tuple], root, depth: int):
    """`branch` and none of `others`: for a branch of a few values, those that every other
    branch provably rejects; else the branch beside the others' negations."""
    if values is not None and others:
        verdicts = [[_verdict_of(other, v, root) for other in others] for v in values]
        if not any(None in row for row in verdicts):
            return _enum([v for v, row in zip(values, verdicts) if True not in row])
    return _all([branch, *(_negate_within(branch, other, root, depth) for other in others)])


def _negate_within(branch, other: tuple, root, depth: int):
    """What `other` (rewritten, as given) rejects, beside `branch`: where `other`'s `type` admits
    every type `branch` does, it rejects none of them and is left out (an integer's negation has
    no type of its own)."""
    outer, inner = _declared(branch), _declared(other[0])
    if outer is not None and inner is not None and all(t in inner or t == "integer" and "number" in inner
                                                       for t in outer):
        other = tuple({k: v for k, v in o.items() if k != "type"} if isinstance(o, dict) else o for o in other)
    return _negate_either(other[1], other[0], root, depth)


def _negate_either(given, rewritten, root, depth: int):
    """The negation of a subschema as given, else as rewritten: either may be the one that
    negates (a double `not` as given, a `uniqueItems` over a few values as rewritten)."""
    try:
        return negate(given, root, depth)
    except _Inexpressible:
        return negate(rewritten, root, depth)


def _declared(schema) -> set[str] | None:
    """The type names a schema declares, when it does."""
    declared = schema.get("type") if isinstance(schema, dict) else None
    names = [declared] if isinstance(declared, str) else declared if isinstance(declared, list) else None
    if not names or not all(isinstance(n, str) for n in names):
        return None
    return set(names)


def _finite_of(pair: tuple, root) -> list | None:
    values = _finite(pair[1], root)
    return values if values is not None else _finite(pair[0], root)


def _verdict_of(pair: tuple, value, root) -> bool | None:
    verdict = _verdict(pair[1], value, root)
    return verdict if verdict is not None else _verdict(pair[0], value, root)


def _enum(values: list):
    return {"enum": values} if values else False


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
    if not _known(key, root):
        return False, {key}  # an unknown keyword constrains nothing, so nothing breaks it
    if key == "not":
        return rewrite(v, root, depth), {key}
    if key == "$ref":
        return negate(_resolve(v, root, depth), root, depth + 1), {key}
    if key == "type":
        return _not_types(v), {key}
    if key in ("enum", "const"):
        return _not_values(v if key == "enum" else [v], root), {key}
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
        if not isinstance(v, list):
            raise _Inexpressible  # draft-3 flag
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
    if key == "propertyNames":
        return _not_names(_target(v, root), root), {key}
    raise _Inexpressible  # pattern, format, multipleOf, uniqueItems, propertyNames, unevaluated*, $dynamicRef, ...


def _not_types(declared) -> dict:
    names = {declared} if isinstance(declared, str) else set(declared)
    if "integer" in names and "number" not in names:
        raise _Inexpressible  # a number with a fraction has no type of its own
    rest = [t for t in TYPES if t not in names and not (t == "number" and "integer" in names)]
    return {"type": rest} if rest else False


def _not_values(values: list, root):
    """Every value except these."""
    composite = _distinct([v for v in values if isinstance(v, (list, dict))])
    scalars = _not_scalars([v for v in values if not isinstance(v, (list, dict))])
    return _all([scalars, *(_not_one(v, root) for v in composite)])


def _not_one(value, root):
    """Every value except this array or object: another type, another size or set of keys, or
    an item or property that differs."""
    kind = _type_of(value)
    parts = [{"type": [t for t in TYPES if t != kind]}]
    if kind == "array":
        parts.append({"type": "array", "minItems": len(value) + 1})
        parts.append({"type": "array", "maxItems": len(value) - 1} if value else False)
        for i, item in enumerate(value):
            position = _tuple([True] * i + [_not_values([item], root)], True, root)
            parts.append({"type": "array", "minItems": len(value), **position})
    else:
        parts.append(_key_outside(list(value)))
        parts += [{"type": "object", "properties": {key: False}} for key in value]
        parts += [{"type": "object", "required": [key], "properties": {key: _not_values([item], root)}}
                  for key, item in value.items()]
    return _any(parts)


def _not_scalars(values: list):
    """Every value except these (none an array or an object)."""
    by_type: dict[str, list] = {}
    for value in values:
        by_type.setdefault(_type_of(value), []).append(value)
    parts = [{"type": [t for t in TYPES if t not in by_type]}] if len(by_type) < len(TYPES) else []
    if "boolean" in by_type and len(set(by_type["boolean"])) == 1:
        parts.append({"enum": [not by_type["boolean"][0]]})  # `const` is ignored before draft 6
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
    """An object with a named property that breaks its schema, or, when no other key is
    allowed, with another key (an extra key breaking a schema: inexpressible)."""
    rest = s.get("additionalProperties", True)
    if s.get("patternProperties") or not (rest is False or _trivial(rest)):
        raise _Inexpressible
    named = s.get("properties", {})
    parts = [{"type": "object", "required": [name], "properties": {name: negate(sub, root, depth)}}
             for name, sub in named.items()]
    if rest is False:
        parts.append(_key_outside(list(named)))
    return _any(parts)


def _key_outside(names: list[str]):
    """An object with a key not in `names`: for each subset of them it has, one key more."""
    names = sorted(set(names))
    if 2 ** len(names) > MAX_KEY_SUBSETS:
        raise _Inexpressible
    parts = []
    for size in range(len(names) + 1):
        for have in itertools.combinations(names, size):
            part = {"type": "object", "minProperties": size + 1}
            if have:
                part["required"] = list(have)
            if size < len(names):
                part["properties"] = {name: False for name in names if name not in have}
            parts.append(part)
    return _any(parts)


def _not_names(names, root):
    """An object with a key that `propertyNames: names` rejects."""
    if _trivial_names(names):
        return False
    if names is False:
        return {"type": "object", "minProperties": 1}
    allowed = _finite(names, root)
    if allowed is not None:
        return _key_outside([n for n in allowed if isinstance(n, str)])
    banned = _banned_names(names, root)
    if banned is not None:
        return _any([{"type": "object", "required": [name]} for name in banned])
    raise _Inexpressible


def _not_items(s: dict, root, depth: int):
    """An array with an item at a position that breaks its schema."""
    prefix = s.get("prefixItems") if _draft(root) >= 2020 else None  # a keyword older drafts lack
    items = s.get("items")
    if prefix is None and isinstance(items, list):  # draft 7 tuple form
        prefix, items = items, s.get("additionalItems", True)
    elif "additionalItems" in s:
        raise _Inexpressible  # draft 7: additionalItems is ignored unless items is a list
    parts = []
    for i, sub in enumerate(prefix or []):
        position = {"type": "array", "minItems": i + 1, **_tuple([True] * i + [negate(sub, root, depth)], True, root)}
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


def _draft(root) -> int:
    """The root's dialect as a sortable number (the newest when `$schema` names none)."""
    return _draft_of(str(root.get("$schema", "")) if isinstance(root, dict) else "")


@functools.lru_cache(maxsize=64)
def _draft_of(uri: str) -> int:
    for tag, number in (("draft-03", 3), ("draft-04", 4), ("draft-06", 6), ("draft-07", 7), ("2019-09", 2019)):
        if tag in uri:
            return number
    return 2020


def _tuple(positions: list, rest, root) -> dict:
    """Array keywords for these positions, then `rest` for every later item, in the root's dialect."""
    if _draft(root) < 2020:
        return {"items": positions, **({} if rest is True else {"additionalItems": rest})}
    return {"prefixItems": positions, **({} if rest is True else {"items": rest})}


def _trivial(schema) -> bool:
    """Does `schema` admit every value (true, or annotations only)?"""
    return schema is True or isinstance(schema, dict) and all(k in ANNOTATIONS for k in schema)


def _target(schema, root, depth: int = 0):
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


def _canon(value) -> str:
    """The same text for values JSON Schema calls equal (`1` and `1.0`, any key order)."""
    return json.dumps(_integral(value), sort_keys=True)


def _canon_set(values: list) -> frozenset[str]:
    return _memo("enum", values, lambda: frozenset(_canon(v) for v in values))


def _memo(kind: str, part, compute):
    """`compute()` for a part of the schema being rewritten, once per rewrite (outside one: each time)."""
    cache = getattr(_budget, "memo", None)
    if cache is None:
        return compute()
    hit = cache.get((kind, id(part)))
    if hit is None or hit[0] is not part:  # the part itself is held, so its id names it alone
        hit = cache[(kind, id(part))] = (part, compute())
    return hit[1]


def _distinct(values: list) -> list:
    seen: dict[str, object] = {}
    for value in values:
        seen.setdefault(_canon(value), value)
    return list(seen.values())


def _finite(schema, root, depth: int = 0) -> list | None:
    """The values `schema` admits, when it provably admits only a few (distinct as JSON); None
    when it may admit more, or when this cannot tell."""
    if depth == 0 and isinstance(schema, dict):
        return _memo("finite", schema, lambda: _finite_values(schema, root, 0))
    return _finite_values(schema, root, depth)


def _finite_values(schema, root, depth: int) -> list | None:
    if schema is False:
        return []
    if not isinstance(schema, dict) or depth > MAX_REF_DEPTH:
        return None
    candidates = _candidates(schema, root, depth)
    if candidates is None or len(candidates) > MAX_FINITE:
        return None
    verdicts = [_verdict(schema, value, root, depth) for value in candidates]
    if None in verdicts:
        return None
    return [value for value, ok in zip(candidates, verdicts) if ok]


def _candidates(schema: dict, root, depth: int) -> list | None:
    """Values among which are all that `schema` admits (its own verdict filters them)."""
    if "$ref" in schema and _draft(root) <= 7:
        schema = {"$ref": schema["$ref"]}  # its siblings are ignored
    if "const" in schema and _draft(root) >= 6:
        return [schema["const"]]
    if isinstance(schema.get("enum"), list):
        return _distinct(schema["enum"])
    declared = schema.get("type")
    names = {declared} if isinstance(declared, str) else set(declared) if isinstance(declared, list) else None
    if names and all(isinstance(n, str) for n in names) and names <= {"boolean", "null"}:
        return [v for v in (True, False, None) if _type_of(v) in names]
    if "$ref" in schema:
        try:
            return _finite(resolve_pointer(schema["$ref"], root), root, depth + 1)
        except LookupError:
            return None
    for member in schema.get("allOf", []) if isinstance(schema.get("allOf"), list) else []:
        values = _finite(member, root, depth + 1)
        if values is not None:
            return values
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            parts = [_finite(member, root, depth + 1) for member in schema[key]]
            if all(part is not None for part in parts):
                return _distinct([v for part in parts for v in part])
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
          "propertyNames", "allOf", "anyOf", "oneOf", "not", "if", "then", "else", "$ref"}


def _known(key: str, root) -> bool:
    """Is `key` a keyword in the root's dialect?"""
    return key in KEYWORDS and _draft(root) >= SINCE.get(key, 0)


def _verdict(schema, value, root, depth: int = 0) -> bool | None:
    """Does `schema` admit `value`? None when it uses a keyword this does not evaluate (a
    `pattern`, a `format`, ...) and no other keyword rejects the value."""
    if isinstance(schema, bool):
        return schema
    _budget.verdicts = getattr(_budget, "verdicts", math.inf) - 1
    if _budget.verdicts < 0:
        return None
    if not isinstance(schema, dict) or depth > MAX_REF_DEPTH or _draft(root) <= 3:
        return None  # the oldest draft's `required` sits on the property: not read here
    keys = [k for k in schema if _known(k, root)]
    if "$ref" in schema and _draft(root) <= 7:
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
    if kind is not None and _type_of(value) != kind:
        return True  # a keyword for another kind of value lets this one through
    if key not in TESTED:
        return None
    v = s[key]
    if key == "type":
        return _type_verdict(v, value, _draft(root))
    if key == "enum":
        return _canon(value) in _canon_set(v) if isinstance(v, list) else None
    if key == "const":
        return _canon(value) == _canon(v)
    if key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"):
        return _number_verdict(key, s, value)
    if key in ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties"):
        return _count_verdict(key, v, len(value))
    if key == "uniqueItems":
        return v is not True or len({_canon(x) for x in value}) == len(value)
    if key in ("items", "prefixItems", "additionalItems"):
        return _items_verdict(s, value, root, depth)
    if key == "required":
        return all(name in value for name in v) if isinstance(v, list) else None
    if key in ("properties", "patternProperties", "additionalProperties"):
        return _properties_verdict(s, value, root, depth)
    if key == "propertyNames":
        return _all_verdicts(_verdict(v, name, root, depth + 1) for name in value)
    if key == "$ref":
        try:
            return _verdict(resolve_pointer(v, root), value, root, depth + 1)
        except LookupError:
            return None
    return _logic_verdict(key, s, value, root, depth)


def _logic_verdict(key: str, s: dict, value, root, depth: int) -> bool | None:
    v = s[key]
    if key in ("then", "else"):
        return True  # read with `if`
    if key == "if":
        condition = _verdict(v, value, root, depth + 1)
        branch = s.get("then", True) if condition else s.get("else", True)
        return None if condition is None else _verdict(branch, value, root, depth + 1)
    if key == "not":
        verdict = _verdict(v, value, root, depth + 1)
        return None if verdict is None else not verdict
    if not isinstance(v, list):
        return None
    verdicts = [_verdict(member, value, root, depth + 1) for member in v]
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
    kind = _type_of(value)
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
    if _draft(root) < 2020:  # a tuple is an `items` list; `prefixItems` is no keyword yet
        positions, rest = (items, s.get("additionalItems", True)) if isinstance(items, list) else ([], items)
    elif isinstance(items, list):
        return None
    else:
        positions, rest = s.get("prefixItems", []), items
    if not isinstance(positions, list):
        return None
    schemas = [positions[i] if i < len(positions) else rest for i in range(len(value))]
    return _all_verdicts(_verdict(sub, x, root, depth + 1) for sub, x in zip(schemas, value))


def _properties_verdict(s: dict, value: dict, root, depth: int) -> bool | None:
    if s.get("patternProperties"):
        return None  # which keys a pattern matches: a regex engine would decide
    named = s.get("properties", {})
    rest = s.get("additionalProperties", True)
    if not isinstance(named, dict):
        return None
    return _all_verdicts(_verdict(named[k] if k in named else rest, x, root, depth + 1) for k, x in value.items())


# ---- disjointness: no value satisfies two branches ----

def _types(branch, draft: int = 2020) -> set[str] | None:
    """The JSON types a branch admits, when it says (None: any)."""
    if not isinstance(branch, dict):
        return None if branch is True else set()
    found: list[set[str]] = []
    if "const" in branch and draft >= 6:
        found.append({_type_of(branch["const"])})
    if isinstance(branch.get("enum"), list):
        found.append({_type_of(v) for v in branch["enum"]})
    declared = branch.get("type")
    names = [declared] if isinstance(declared, str) else declared if isinstance(declared, list) else None
    if names is not None and all(isinstance(n, str) and (n in TYPES or n == "integer") for n in names):
        found.append({"number" if name == "integer" else name for name in names})
    return set.intersection(*found) if found else None


def disjoint(branches: list, root=None) -> bool:
    """Can no JSON value satisfy two of these branches? Proved on each branch, its local `$ref`
    target and its `allOf` members (each admits all the branch admits): by types, by values
    (a branch of a few values the other rejects one by one), by numeric ranges, by a required
    property whose values the other rejects, or by a required key the other does not allow.
    False when unsure."""
    if len(branches) < 2:
        return True
    draft, views = _draft(root), _view_sets(branches, root)
    return all(_sets_disjoint(views[i], views[j], root, draft)
               for i in range(len(branches)) for j in range(i + 1, len(branches)))


def _view_sets(branches: list, root) -> list[list[tuple]]:
    """Each branch's views, each with the few values it admits (or None): read once per branch."""
    draft = _draft(root)
    return [[(view, _finite(view, root)) for view in _views(b, root, draft)] for b in branches]


def _sets_disjoint(xs: list[tuple], ys: list[tuple], root, draft: int) -> bool:
    return any(_views_disjoint(x, y, root, draft) for x in xs for y in ys)


def _views(branch, root, draft: int) -> list:
    """Schemas that each admit every value `branch` admits."""
    out, work = [], [(branch, 0)]
    while work and len(out) < MAX_VIEWS:
        node, depth = work.pop(0)
        if not isinstance(node, dict):
            out.append(node)
            continue
        ref = node.get("$ref")
        if ref is None or draft > 7:  # in older drafts a `$ref` replaces its siblings
            out.append(node)
        if ref is not None and depth < MAX_REF_DEPTH:
            try:
                work.append((resolve_pointer(ref, root), depth + 1))
            except LookupError:
                pass
        if (ref is None or draft > 7) and isinstance(node.get("allOf"), list):
            work.extend((member, depth + 1) for member in node["allOf"])
    return out


def _views_disjoint(x: tuple, y: tuple, root, draft: int) -> bool:
    """Are two views, each with the few values it admits (or None), disjoint?"""
    (a, values_a), (b, values_b) = x, y
    if a is False or b is False:
        return True
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    ta, tb = _types(a, draft), _types(b, draft)
    common = tb if ta is None else ta if tb is None else ta & tb
    if common is not None and not common:
        return True
    if _values_apart(a, values_a, b, values_b, root):
        return True
    if common == {"number"} and _ranges_disjoint(a, b):
        return True
    return common == {"object"} and (_objects_disjoint(a, b, root) or _objects_disjoint(b, a, root))


def _values_apart(a, values_a: list | None, b, values_b: list | None, root) -> bool:
    """Does no value of one (when it admits only a few) satisfy the other?"""
    if values_a is not None and values_b is not None:
        return not _canon_set(values_a) & _canon_set(values_b)
    return _rejects_all(b, values_a, root) or _rejects_all(a, values_b, root)


def _rejects_all(schema, values: list | None, root) -> bool:
    return values is not None and all(_verdict(schema, v, root) is False for v in values)


def _ranges_disjoint(a: dict, b: dict) -> bool:
    """Numbers only: do their `minimum` / `maximum` ranges not meet?"""
    ra, rb = _range(a), _range(b)
    if ra is None or rb is None:
        return False
    return _below(ra[1], rb[0]) or _below(rb[1], ra[0])


def _range(s: dict):
    """((low, exclusive), (high, exclusive)), or None where a bound is not a plain number."""
    lows, highs = [(-math.inf, True)], [(math.inf, True)]
    for key, bounds, exclusive in (("minimum", lows, False), ("exclusiveMinimum", lows, True),
                                   ("maximum", highs, False), ("exclusiveMaximum", highs, True)):
        if key in s:
            if isinstance(s[key], bool) or not isinstance(s[key], (int, float)):
                return None  # draft-4 flags, or no number
            bounds.append((s[key], exclusive))
    # at the same number an exclusive bound is the tighter one
    return max(lows, key=lambda b: (b[0], b[1])), min(highs, key=lambda b: (b[0], not b[1]))


def _below(high, low) -> bool:
    """Is every number up to `high` below every number from `low`?"""
    return high[0] < low[0] or high[0] == low[0] and (high[1] or low[1])


def _objects_disjoint(a: dict, b: dict, root) -> bool:
    """Objects only: does `a` require a key that `b` forbids, or whose values `b` rejects?"""
    required = a.get("required", [])
    if not isinstance(required, list):
        return False
    for key in required:
        rule = _key_schema(b, key)
        if rule is False:
            return True
        own = _key_schema(a, key)
        if own is None and isinstance(a.get("properties"), dict):
            own = a["properties"].get(key, True)  # what a pattern adds only narrows it
        if rule is not None and own is not None and \
                _values_apart(own, _finite(own, root), rule, _finite(rule, root), root):
            return True
    return False


def _key_schema(s: dict, key: str):
    """The schema `s` applies to property `key` (None: a pattern may decide)."""
    if s.get("patternProperties") or not isinstance(s.get("properties", {}), dict):
        return None
    named = s.get("properties", {})
    return named[key] if key in named else s.get("additionalProperties", True)


# ---- uniqueItems over a finite set of items ----

def _unique_items(node: dict, original: dict, root) -> list:
    """Arrays of distinct items from a few values: every ordered selection of them, each a
    tuple with nothing after it; values of other types as they were."""
    if any(k in node for k in ("prefixItems", "additionalItems", "contains")) or _unevaluated(root) or \
            "items" in _pointed(root):
        raise _Inexpressible  # a `$ref` may point at the `items` this removes
    items = original.get("items")
    values = _finite(items, root) if isinstance(items, (dict, bool)) else None
    if values is None:
        raise _Inexpressible
    low, high = node.get("minItems", 0), node.get("maxItems", len(values))
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in (low, high)):
        raise _Inexpressible
    high = min(high, len(values))  # more distinct items than values cannot be
    sizes = range(low, high + 1)
    if not sizes or sum(math.perm(len(values), k) for k in sizes) > MAX_UNIQUE_BRANCHES:
        raise _Inexpressible
    branches = [_exact_tuple(chosen, root) for k in sizes for chosen in itertools.permutations(values, k)]
    if node.get("type") not in ("array", ["array"]):
        branches.append({"type": [t for t in TYPES if t != "array"]})
    for key in ("items", "uniqueItems", "minItems", "maxItems"):
        node.pop(key, None)
    return branches


def _pointed(root) -> set[str]:
    """Every key a local `$ref` pointer in the schema passes through."""
    parts: set[str] = set()
    work = [root]
    while work:
        node = work.pop()
        if isinstance(node, list):
            work.extend(node)
        elif isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/"):
                parts.update(pointer_parts(ref))
            work.extend(v for k, v in node.items() if k not in ("const", "enum", "default", "examples"))
    return parts


def _unevaluated(root) -> bool:
    """Does the schema use `unevaluated*`, which sees which keys and items other keywords named?"""
    return '"unevaluated' in json.dumps(root)


def _exact_tuple(values: tuple, root) -> dict:
    if not values:
        return {"type": "array", "maxItems": 0}
    return {"type": "array", "minItems": len(values), **_tuple([{"enum": [v]} for v in values], False, root)}


# ---- propertyNames: a set of names or a regular pattern ----

def _trivial_names(names) -> bool:
    """Does `propertyNames: names` admit every key (every key is a string)?"""
    return _trivial(names) or isinstance(names, dict) and set(names) - ANNOTATIONS == {"type"} and \
        (names["type"] == "string" or isinstance(names["type"], list) and "string" in names["type"])


def _property_names(node: dict, names, root) -> None:
    """In place: `propertyNames` as `properties` / `patternProperties` / `additionalProperties`."""
    names = _target(names, root)
    if _draft(root) < 6 or _unevaluated(root):
        raise _Inexpressible  # no such keyword there / keys it names would count as evaluated
    required = node.get("required", [])
    if not isinstance(required, list) or not isinstance(node.get("properties", {}), dict):
        raise _Inexpressible
    if names is False:
        _names_in(node, [], required, root)
        return
    allowed = _finite(names, root)
    if allowed is not None:
        _names_in(node, [n for n in allowed if isinstance(n, str)], required, root)
        return
    banned = _banned_names(names, root)
    if banned is not None:
        if set(banned) & set(required):
            raise _Inexpressible  # unsatisfiable for objects: left for the backend to refuse
        _unpointed(set(banned), root)
        node["properties"] = {**node.get("properties", {}), **{name: False for name in banned}}
        return
    _names_matching(node, *_name_rule(names), required, root)


def _names_in(node: dict, allowed: list[str], required: list, root) -> None:
    """Only these keys: each with the schema it had (named, or the additional one)."""
    named, rest = node.get("properties", {}), node.get("additionalProperties", True)
    if "patternProperties" in node or not set(required) <= set(allowed):
        raise _Inexpressible
    _unpointed(set(named) - set(allowed), root)
    kept = {name: named.get(name, rest) for name in allowed}
    _set_properties(node, {name: sub for name, sub in kept.items() if sub is not False})
    node["additionalProperties"] = False


def _set_properties(node: dict, named: dict) -> None:
    if named:
        node["properties"] = named
    else:
        node.pop("properties", None)


def _unpointed(removed: set[str], root) -> None:
    """Raise where a `$ref` may point at what the rewrite removes or replaces."""
    if _pointed(root) & (removed | {"propertyNames", "additionalProperties"}):
        raise _Inexpressible


def _banned_names(names, root) -> list[str] | None:
    """The keys `{"not": X}` forbids, when X admits only a few values."""
    if not isinstance(names, dict) or set(names) - ANNOTATIONS != {"not"}:
        return None
    values = _finite(_target(names["not"], root), root)
    return None if values is None else [v for v in values if isinstance(v, str)]


def _name_rule(names) -> tuple[str, object]:
    """(a regex for the backend, a test of one key) for keys matching a pattern or within lengths."""
    if not isinstance(names, dict):
        raise _Inexpressible
    keys = set(names) - ANNOTATIONS - {"type"}
    if "type" in names and not _trivial_names({"type": names["type"]}):
        raise _Inexpressible
    if keys == {"pattern"} and isinstance(names["pattern"], str):
        pattern = names["pattern"]
        if regex_features.features(pattern) or not _python_syntax(pattern):
            raise _Inexpressible  # its meaning may differ between engines
        return _exact_dots(pattern), lambda key: _ecma_search(pattern, key)
    if keys and keys <= {"minLength", "maxLength"}:
        low, high = names.get("minLength", 0), names.get("maxLength")
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in (low, high if high is not None else 0)):
            raise _Inexpressible
        regex = "^[\\s\\S]{%d,%s}$" % (low, "" if high is None else high)
        return regex, lambda key: low <= len(key) and (high is None or len(key) <= high)
    raise _Inexpressible


def _names_matching(node: dict, regex: str, test, required: list, root) -> None:
    """Only keys that pass `test`: named properties that do keep their schema, any other is
    free (there was no schema for additional keys), the rest are not allowed."""
    rest = node.get("additionalProperties", True)
    if "patternProperties" in node or not (rest is False or _trivial(rest)):
        raise _Inexpressible  # a named key would meet the additional keys' schema too
    named = node.get("properties", {})
    verdicts = {name: test(name) for name in set(named) | set(required)}
    if None in verdicts.values() or not all(verdicts[name] for name in required):
        raise _Inexpressible
    _unpointed({name for name in named if not verdicts[name]}, root)
    _set_properties(node, {name: sub for name, sub in named.items() if verdicts[name]})
    if rest is not False:
        node["patternProperties"] = {regex: {}}
    node["additionalProperties"] = False


# An escaped character that means the same to ECMA-262 and to Python's `re` (ASCII).
_SAME_ESCAPES = set("dDwWsStnrvf") | set("\\^$.|?*+()[]{}/-")
# Text whose meaning differs between the two: empty classes, Python-only groups, `{,n}`, set operations.
_DIFFERENT = ("[]", "[^]", "{,", "[[", "&&", "--", "~~", "||")
ECMA_DOT = "[^\\n\\r\\u2028\\u2029]"  # what `.` matches in ECMA-262


def _python_syntax(pattern: str) -> bool:
    """Does Python's `re` (ASCII) read `pattern` as ECMA-262 does, over ASCII keys without line
    breaks? False where the two may differ."""
    if "(?" in pattern.replace("(?:", "") or any(text in pattern for text in _DIFFERENT):
        return False
    i = 0
    while i < len(pattern):
        if pattern[i] != "\\":
            i += 1
        elif pattern[i + 1:i + 2] == "x" and re.fullmatch(r"[0-9a-fA-F]{2}", pattern[i + 2:i + 4]):
            i += 4
        elif pattern[i + 1:i + 2] == "u" and re.fullmatch(r"[0-9a-fA-F]{4}", pattern[i + 2:i + 6]):
            i += 6
        elif pattern[i + 1:i + 2] in _SAME_ESCAPES and pattern[i + 1:i + 2]:
            i += 2
        else:
            return False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a FutureWarning marks syntax Python may read otherwise
        try:
            re.compile(pattern, re.ASCII)
        except (re.error, Warning):
            return False
    return True


def _ecma_search(pattern: str, key: str) -> bool | None:
    """Does the ECMA-262 regex `pattern` match somewhere in `key`? None where Python's `re`
    might answer otherwise (a key with line breaks or beyond ASCII)."""
    if not key.isascii() or any(c in key for c in "\n\r") or not _python_syntax(pattern):
        return None
    return re.search(pattern, key, re.ASCII) is not None


def _exact_dots(pattern: str) -> str:
    """`pattern` with each `.` outside a class written as ECMA-262 means it (no line terminator):
    a backend's `.` may let a carriage return through."""
    out, i = [], 0
    while i < len(pattern):
        if pattern[i] == "\\":
            out.append(pattern[i:i + 2])
            i += 2
        elif pattern[i] == "[":
            end = _class_end(pattern, i)
            out.append(pattern[i:end])
            i = end
        else:
            out.append(ECMA_DOT if pattern[i] == "." else pattern[i])
            i += 1
    return "".join(out)


def _class_end(pattern: str, i: int) -> int:
    """Past the character class opening at `i` (ECMA-262: the first `]` closes it)."""
    j = i + 1
    while j < len(pattern) and pattern[j] != "]":
        j += 2 if pattern[j] == "\\" else 1
    return j + 1
