"""Proofs that no JSON value satisfies two schemas (`disjoint`), which let a `oneOf` be an
`anyOf`: by types, by values, by numeric ranges and by object keys, each read on a branch, its
local `$ref` target and its `allOf` members. False when unsure.
"""

from __future__ import annotations

import math

from loraplex.grammar.schema.schema_values import (MAX_REF_DEPTH, TYPES, admits, canon_set, dialect, finite_values,
                                            resolve_pointer, type_of)

MAX_VIEWS = 8  # schemas (a branch, its `$ref` target, its `allOf` members) compared per branch


# ---- disjointness: no value satisfies two branches ----

def _types(branch, draft: int = 2020) -> set[str] | None:
    """The JSON types a branch admits, when it says (None: any)."""
    if not isinstance(branch, dict):
        return None if branch is True else set()
    found: list[set[str]] = []
    if "const" in branch and draft >= 6:
        found.append({type_of(branch["const"])})
    if isinstance(branch.get("enum"), list):
        found.append({type_of(v) for v in branch["enum"]})
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
    draft, views = dialect(root), view_sets(branches, root)
    return all(sets_disjoint(views[i], views[j], root, draft)
               for i in range(len(branches)) for j in range(i + 1, len(branches)))


def view_sets(branches: list, root) -> list[list[tuple]]:
    """Each branch's views, each with the few values it admits (or None): read once per branch."""
    draft = dialect(root)
    return [[(view, finite_values(view, root)) for view in _views(b, root, draft)] for b in branches]


def sets_disjoint(xs: list[tuple], ys: list[tuple], root, draft: int) -> bool:
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
        return not canon_set(values_a) & canon_set(values_b)
    return _rejects_all(b, values_a, root) or _rejects_all(a, values_b, root)


def _rejects_all(schema, values: list | None, root) -> bool:
    return values is not None and all(admits(schema, v, root) is False for v in values)


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
                _values_apart(own, finite_values(own, root), rule, finite_values(rule, root), root):
            return True
    return False


def _key_schema(s: dict, key: str):
    """The schema `s` applies to property `key` (None: a pattern may decide)."""
    if s.get("patternProperties") or not isinstance(s.get("properties", {}), dict):
        return None
    named = s.get("properties", {})
    return named[key] if key in named else s.get("additionalProperties", True)
