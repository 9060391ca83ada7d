"""Exact rewrites of two keywords over finite or regular sets: `uniqueItems` over a few item
values (every ordered selection of distinct items) and `propertyNames` (a set of names, a
pattern or lengths, as `properties` / `patternProperties` / `additionalProperties`). Where no
exact rewrite exists they raise Inexpressible and the keyword stays, refused by name.
"""

from __future__ import annotations

import itertools
import json
import math

from loraplex.grammar.schema import regex_features
from loraplex.grammar.schema.ecma_regex import ecma_search, exact_dots, python_syntax
from loraplex.grammar.schema.rewrite_state import Inexpressible, memo
from loraplex.grammar.schema.schema_values import (ANNOTATIONS, TYPES, dialect, finite_values, follow_refs, pointer_parts,
                                            trivial, tuple_keywords)

MAX_UNIQUE_BRANCHES = 200  # ordered selections a `uniqueItems` over a finite set may become


# ---- uniqueItems over a finite set of items ----

def unique_items(node: dict, original: dict, root) -> list:
    """Arrays of distinct items from a few values: every ordered selection of them, each a
    tuple with nothing after it; values of other types as they were."""
    if any(k in node for k in ("prefixItems", "additionalItems", "contains")) or uses_unevaluated(root) or \
            "items" in pointed(root):
        raise Inexpressible  # a `$ref` may point at the `items` this removes
    items = original.get("items")
    values = finite_values(items, root) if isinstance(items, (dict, bool)) else None
    if values is None:
        raise Inexpressible
    low, high = node.get("minItems", 0), node.get("maxItems", len(values))
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in (low, high)):
        raise Inexpressible
    high = min(high, len(values))  # more distinct items than values cannot be
    sizes = range(low, high + 1)
    if not sizes or sum(math.perm(len(values), k) for k in sizes) > MAX_UNIQUE_BRANCHES:
        raise Inexpressible
    branches = [_exact_tuple(chosen, root) for k in sizes for chosen in itertools.permutations(values, k)]
    if node.get("type") not in ("array", ["array"]):
        branches.append({"type": [t for t in TYPES if t != "array"]})
    for key in ("items", "uniqueItems", "minItems", "maxItems"):
        node.pop(key, None)
    return branches


def pointed(root) -> set[str]:
    """Every key a local `$ref` pointer in the schema passes through (read once per rewrite)."""
    return memo("pointed", root, lambda: _pointed_parts(root))


def _pointed_parts(root) -> set[str]:
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


def uses_unevaluated(root) -> bool:
    """Does the schema use `unevaluated*`, which sees which keys and items other keywords named?"""
    return memo("unevaluated", root, lambda: '"unevaluated' in json.dumps(root))


def _exact_tuple(values: tuple, root) -> dict:
    if not values:
        return {"type": "array", "maxItems": 0}
    return {"type": "array", "minItems": len(values), **tuple_keywords([{"enum": [v]} for v in values], False, root)}


# ---- propertyNames: a set of names or a regular pattern ----

def trivial_names(names) -> bool:
    """Does `propertyNames: names` admit every key (every key is a string)?"""
    return trivial(names) or isinstance(names, dict) and set(names) - ANNOTATIONS == {"type"} and \
        (names["type"] == "string" or isinstance(names["type"], list) and "string" in names["type"])


def property_names(node: dict, names, root) -> None:
    """In place: `propertyNames` as `properties` / `patternProperties` / `additionalProperties`."""
    names = follow_refs(names, root)
    if dialect(root) < 6 or uses_unevaluated(root):
        raise Inexpressible  # no such keyword there / keys it names would count as evaluated
    required = node.get("required", [])
    if not isinstance(required, list) or not isinstance(node.get("properties", {}), dict):
        raise Inexpressible
    if names is False:
        _names_in(node, [], required, root)
        return
    allowed = finite_values(names, root)
    if allowed is not None:
        _names_in(node, [n for n in allowed if isinstance(n, str)], required, root)
        return
    banned = banned_names(names, root)
    if banned is not None:
        if set(banned) & set(required):
            raise Inexpressible  # unsatisfiable for objects: left for the backend to refuse
        _unpointed(set(banned), root)
        node["properties"] = {**node.get("properties", {}), **{name: False for name in banned}}
        return
    _names_matching(node, *_name_rule(names), required, root)


def _names_in(node: dict, allowed: list[str], required: list, root) -> None:
    """Only these keys: each with the schema it had (named, or the additional one)."""
    named, rest = node.get("properties", {}), node.get("additionalProperties", True)
    if "patternProperties" in node or not set(required) <= set(allowed):
        raise Inexpressible
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
    if pointed(root) & (removed | {"propertyNames", "additionalProperties"}):
        raise Inexpressible


def banned_names(names, root) -> list[str] | None:
    """The keys `{"not": X}` forbids, when X admits only a few values."""
    if not isinstance(names, dict) or set(names) - ANNOTATIONS != {"not"}:
        return None
    values = finite_values(follow_refs(names["not"], root), root)
    return None if values is None else [v for v in values if isinstance(v, str)]


def _name_rule(names) -> tuple[str, object]:
    """(a regex for the backend, a test of one key) for keys matching a pattern or within lengths."""
    if not isinstance(names, dict):
        raise Inexpressible
    keys = set(names) - ANNOTATIONS - {"type"}
    if "type" in names and not trivial_names({"type": names["type"]}):
        raise Inexpressible
    if keys == {"pattern"} and isinstance(names["pattern"], str):
        pattern = names["pattern"]
        if regex_features.features(pattern) or not python_syntax(pattern):
            raise Inexpressible  # its meaning may differ between engines
        return exact_dots(pattern), lambda key: ecma_search(pattern, key)
    if keys and keys <= {"minLength", "maxLength"}:
        low, high = names.get("minLength", 0), names.get("maxLength")
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in (low, high if high is not None else 0)):
            raise Inexpressible
        regex = "^[\\s\\S]{%d,%s}$" % (low, "" if high is None else high)
        return regex, lambda key: low <= len(key) and (high is None or len(key) <= high)
    raise Inexpressible


def _names_matching(node: dict, regex: str, test, required: list, root) -> None:
    """Only keys that pass `test`: named properties that do keep their schema, any other is
    free (there was no schema for additional keys), the rest are not allowed."""
    rest = node.get("additionalProperties", True)
    if "patternProperties" in node or not (rest is False or trivial(rest)):
        raise Inexpressible  # a named key would meet the additional keys' schema too
    named = node.get("properties", {})
    verdicts = {name: test(name) for name in set(named) | set(required)}
    if None in verdicts.values() or not all(verdicts[name] for name in required):
        raise Inexpressible
    _unpointed({name for name in named if not verdicts[name]}, root)
    _set_properties(node, {name: sub for name, sub in named.items() if verdicts[name]})
    if rest is not False:
        node["patternProperties"] = {regex: {}}
    node["additionalProperties"] = False
