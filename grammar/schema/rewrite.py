"""Exact rewrites of JSON Schema keywords no backend enforces into ones they do: `not` (pushed
inward until it disappears), `if` / `then` / `else`, `dependencies`, `dependentRequired`,
`dependentSchemas`, `oneOf` (as `anyOf` where the branches are provably disjoint, at once or
one JSON type at a time, or their overlaps can be cut out), a node that provably admits only a
few values (as their `enum`), `uniqueItems` over a small finite set of items (every ordered
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

This module is the entry and the rewrite itself (`not`, `oneOf`, conditionals, dependencies);
the rest lives beside it, imported one way: finite_keywords.py (`uniqueItems`, `propertyNames`)
-> disjoint.py (disjointness proofs) -> schema_values.py (values and verdicts, dialect,
pointers) -> rewrite_state.py (the one budget and memo per rewrite call); ecma_regex.py says
what a pattern means in ECMA-262.
"""

from __future__ import annotations

import copy
import itertools
import json
import math

from loraplex.grammar.schema.disjoint import disjoint, sets_disjoint, view_sets
from loraplex.grammar.schema.finite_keywords import (banned_names, pointed, property_names, trivial_names, unique_items,
                                                     uses_unevaluated)
from loraplex.grammar.schema.rewrite_state import MAX_STEPS, MAX_VERDICTS, Inexpressible, TooBig, budget, spend
from loraplex.grammar.schema.schema_values import (ANNOTATIONS, KIND_OF, MAX_REF_DEPTH, TYPES, admits, canon, dialect,
                                                   distinct, finite_values, follow_refs, integral, known,
                                                   pointer_parts, resolve_pointer, trivial, tuple_keywords, type_of)

MAX_COMPLEMENT_CHARS = 4096  # strings an `enum` negation may exclude, in all
COUNTS = {"minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties", "minContains",
          "maxContains"}
MAX_KEY_SUBSETS = 64  # subsets of named keys that "a key outside these" may enumerate
RESOURCE_NAMES = ("$id", "id", "$anchor", "$dynamicAnchor")  # what a `$ref` may name a subschema by
# Keywords some backend refuses, or enforces only after a rewrite that may fail: a node with one
# of them that provably admits only a few values is served as those values instead.
UNSERVED = {"not", "oneOf", "if", "allOf", "anyOf", "$ref", "uniqueItems", "contains", "patternProperties",
            "propertyNames", "dependencies", "dependentRequired", "dependentSchemas", "multipleOf", "minProperties",
            "maxProperties"}


def rewrite(schema, root=None, depth: int = 0, deep: bool = True):
    """`schema` with `not`, `oneOf`, conditionals, dependencies, `uniqueItems` and
    `propertyNames` rewritten where that is exact (a new object; the input is left alone). Not
    `deep`: only a provably disjoint `oneOf` becomes an `anyOf` (for backends that refuse `allOf`
    beside other keywords anyway), and keywords that constrain nothing go. A deep
    rewrite that would take more than MAX_STEPS steps (a hostile nesting of `oneOf` and `not`)
    falls back to the light one: what it left is then refused by name."""
    if root is None:
        budget.left = MAX_STEPS if deep else math.inf  # the light rewrite only copies
        budget.memo = {}  # what was read off this schema's parts, while it (unchanged) is read
        budget.verdicts = MAX_VERDICTS  # past it a proof is unsure: the keyword stays, refused by name
        try:
            return _rewrite({} if schema is True else schema, schema, depth, deep)
        except (TooBig, RecursionError):  # RecursionError: `$ref` chains negated through each other
            budget.left = math.inf
            return _rewrite({} if schema is True else schema, schema, depth, False)
        finally:
            budget.memo, budget.verdicts, budget.named = None, math.inf, None
    return _rewrite(schema, root, depth, deep)


def _rewrite(schema, root, depth: int, deep: bool):
    spend()
    if isinstance(schema, list):
        return [rewrite(s, root, depth, deep) for s in schema]
    if not isinstance(schema, dict):
        return schema
    collapsed = _collapse(schema, root, depth, deep)
    if collapsed is not None:
        return collapsed
    out = {}
    for key, value in schema.items():
        if key in COUNTS and isinstance(value, float) and value.is_integer():
            out[key] = int(value)  # 2.0 is the count 2; some backends want an integer
        elif key in ("const", "enum", "default", "examples") or not isinstance(value, (dict, list)):
            out[key] = value
        elif key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies"):
            out[key] = {k: rewrite(v, root, depth, deep) for k, v in value.items()} if isinstance(value, dict) \
                else value
        elif key == "dependentRequired":
            out[key] = value  # names, not schemas
        else:
            out[key] = rewrite(value, root, depth, deep)
    if out.get("uniqueItems") is False:
        del out["uniqueItems"]  # no constraint at all
    _drop_idle_conditions(out, root)
    if "propertyNames" in out and trivial_names(follow_refs(schema["propertyNames"], root)):
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
        except Inexpressible:
            pass
    if "if" in out:
        try:
            extra.append(_conditional(out, root, depth))
            for key in ("if", "then", "else"):
                out.pop(key, None)
        except Inexpressible:
            pass
    if isinstance(out.get("oneOf"), list) and "anyOf" not in out:
        pairs = list(zip(out["oneOf"], schema["oneOf"]))
        for exact in (_one_per_type, _exactly_one):  # by type first: narrowed branches show disjointness
            try:
                out["anyOf"] = exact(pairs, root, depth)
                del out["oneOf"]
                break
            except Inexpressible:
                pass
    if out.get("uniqueItems") is True:  # after `oneOf`, which may take the node's own `anyOf`
        try:
            _place_any(out, unique_items(out, schema, root), extra)
        except Inexpressible:
            pass
    if "propertyNames" in out:
        try:
            property_names(out, schema["propertyNames"], root)
            del out["propertyNames"]
        except Inexpressible:
            pass
    for key in ("dependentRequired", "dependentSchemas", "dependencies"):
        if isinstance(out.get(key), dict):
            extra.extend(_dependency(name, need) for name, need in out.pop(key).items())
    if extra:
        out["allOf"] = list(out.get("allOf", [])) + extra
    return out


def _drop_idle_conditions(out: dict, root) -> None:
    """In place: `then` / `else` without an `if` (never applied), an `if` without either (it decides
    nothing, though `unevaluated*` would see what it evaluated); kept where they hold a resource
    another `$ref` may name by its `$id` or anchor."""
    idle = ["then", "else"] if "if" not in out else \
        ["if"] if "then" not in out and "else" not in out and not uses_unevaluated(root) else []
    for key in idle:
        if key in out and not any(f'"{name}"' in json.dumps(out[key]) for name in RESOURCE_NAMES):
            del out[key]


def _collapse(schema: dict, root, depth: int, deep: bool):
    """A node with a keyword in UNSERVED that provably admits only a few values, as their `enum`
    (exact: finite_values lists exactly the values it admits), its annotations and definitions
    kept; False where it admits none. None where it may admit more, where a `$ref` may point
    into what would go, or where `unevaluated*` would see which keys and items it evaluated."""
    if not UNSERVED & schema.keys() or uses_unevaluated(root) or _names_resources(root):
        return None
    try:
        values = finite_values(schema, root)
    except OverflowError:  # an integer too large for a float comparison
        return None
    if values is None or pointed(root) & (set(schema) - ANNOTATIONS):
        return None
    kept = {k: v for k, v in schema.items() if k in ANNOTATIONS}
    for key in ("$defs", "definitions"):
        if isinstance(kept.get(key), dict):
            kept[key] = {name: rewrite(sub, root, depth, deep) for name, sub in kept[key].items()}
    if not values:  # a boolean schema exists since draft 6; `enum: []` is invalid before it
        return False if not kept and dialect(root) >= 6 else None
    return {**kept, "enum": [integral(v) for v in values]}


def _names_resources(root) -> bool:
    """Whether a subschema below the root has a name of its own (`$id`, `$anchor`, ...): a `$ref` inside it may
    then resolve against it, not the root, and a collapse could drop what a `$ref` names; nothing collapses."""
    named = getattr(budget, "named", None)
    if named is None or named[0] is not root:
        budget.named = named = (root, _has_names(root, top=True))
    return named[1]


def _has_names(node, top: bool = False) -> bool:
    if isinstance(node, list):
        return any(_has_names(item) for item in node)
    if not isinstance(node, dict):
        return False
    if any(isinstance(node.get(name), str) for name in RESOURCE_NAMES if not (top and name in ("$id", "id"))):
        return True
    return any(_has_names(value) for value in node.values())


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
        raise Inexpressible  # oneOf [] accepts nothing; leave it to the backend
    finite = [_finite_of(pair, root) for pair in branches]
    if all(values is not None for values in finite):
        counts: dict[str, int] = {}
        for values in finite:
            for value in values:
                counts[canon(value)] = counts.get(canon(value), 0) + 1
        once = [v for values in finite for v in values if counts[canon(v)] == 1]
        return [_enum(once)]
    rewritten, given = view_sets([b for b, _ in branches], root), view_sets([o for _, o in branches], root)
    draft, out = dialect(root), []
    for i, pair in enumerate(branches):
        others = [other for j, other in enumerate(branches) if j != i and not (
            sets_disjoint(rewritten[i], rewritten[j], root, draft) or sets_disjoint(given[i], given[j], root, draft))]
        out.append(_only(pair[0], finite[i], others, root, depth))
    return [b for b in out if b is not False] or [False]


def _one_per_type(branches: list[tuple], root, depth: int) -> list:
    """oneOf as anyOf, one JSON type at a time: a value of a type that two branches admit whole
    is out; beside one such branch, it must break every other; else exactly one of the branches,
    each narrowed to the type (where disjointness often shows: a required key under one, no
    other key allowed by the other). Each branch comes as (rewritten, as given)."""
    out = []
    for kind in TYPES:
        roles = [_role(_own(given, root), kind, root) for _, given in branches]
        whole = roles.count("all")
        narrowed = [(_of_type(b, kind, root), _of_type(o, kind, root)) for (b, o), r in zip(branches, roles)
                    if r == "some"]
        if whole >= 2:
            continue
        if whole == 1:
            out.append(_all([{"type": kind}, *(_negate_either(o, b, root, depth) for b, o in narrowed)]))
        elif narrowed:
            out.extend(_exactly_one(narrowed, root, depth))
    return [b for b in out if b is not False] or [False]


def _own(branch, root):
    """What a branch is read as: a bare `$ref` chain followed; under draft 7 and older a `$ref`
    ignores its siblings."""
    if isinstance(branch, dict) and "$ref" in branch and dialect(root) <= 7:
        branch = {"$ref": branch["$ref"]}
    return follow_refs(branch, root)


def _role(branch, kind: str, root) -> str:
    """Does `branch` admit every value of type `kind` ("all"), none ("none"), or some ("some")?"""
    if branch is True or branch is False:
        return "all" if branch else "none"
    if not isinstance(branch, dict):
        raise Inexpressible
    declared = _declared(branch)
    if declared is not None and kind not in declared and not (kind == "number" and "integer" in declared):
        return "none"
    for key in branch:
        if key == "type" and declared is not None and kind in declared or key in ANNOTATIONS or not known(key, root):
            continue
        other_kind = "string" if key == "format" else KIND_OF.get(key)
        if other_kind is None or other_kind == kind:
            return "some"
    return "all"


def _of_type(branch, kind: str, root):
    """`branch` narrowed to values of type `kind`, as one object where it can be (a disjointness
    proof reads a branch's keywords together)."""
    if branch is True or branch is False:
        return {"type": kind} if branch else False
    declared = _declared(_own(branch, root))
    if declared is not None and declared <= {kind, "integer" if kind == "number" else kind}:
        return branch  # of this type already: kept as it is (a bare circular `$ref` stays bare)
    declared = _declared(branch)
    narrow = "integer" if kind == "number" and declared and "integer" in declared and "number" not in declared \
        else kind
    if "$ref" in branch and dialect(root) <= 7 or "type" in branch and declared is None:
        return {"type": narrow, "allOf": [branch]}  # a `$ref` ignores its siblings there / a type this cannot read
    return {**branch, "type": narrow}


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
    except Inexpressible:
        return negate(rewritten, root, depth)


def _declared(schema) -> set[str] | None:
    """The type names a schema declares, when it does."""
    declared = schema.get("type") if isinstance(schema, dict) else None
    names = [declared] if isinstance(declared, str) else declared if isinstance(declared, list) else None
    if not names or not all(isinstance(n, str) for n in names):
        return None
    return set(names)


def _finite_of(pair: tuple, root) -> list | None:
    values = finite_values(pair[1], root)
    return values if values is not None else finite_values(pair[0], root)


def _verdict_of(pair: tuple, value, root) -> bool | None:
    verdict = admits(pair[1], value, root)
    return verdict if verdict is not None else admits(pair[0], value, root)


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
    """A schema accepting exactly the values `schema` rejects; Inexpressible if none can be
    written without `not`."""
    spend()
    if schema is True or schema == {}:
        return False
    if schema is False:
        return True
    if not isinstance(schema, dict):
        raise Inexpressible
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
    if not known(key, root):
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
            raise Inexpressible
        flipped = {"minimum": "exclusiveMaximum", "maximum": "exclusiveMinimum",
                   "exclusiveMinimum": "maximum", "exclusiveMaximum": "minimum"}[key]
        return {"type": "number", flipped: v}, {key}
    if key in ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties"):
        return _not_count(key, v), {key}
    if key == "required":
        if not isinstance(v, list):
            raise Inexpressible  # draft-3 flag
        return _any([{"type": "object", "properties": {name: False}} for name in v]), {key}
    if key in ("properties", "additionalProperties", "patternProperties"):
        return _not_properties(s, root, depth), {"properties", "additionalProperties", "patternProperties"}
    if key in ("items", "prefixItems", "additionalItems"):
        return _not_items(s, root, depth), {"items", "prefixItems", "additionalItems"}
    if key in ("contains", "minContains", "maxContains"):
        if "minContains" in s or "maxContains" in s or "contains" not in s:
            raise Inexpressible
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
        return _not_names(follow_refs(v, root), root), {key}
    raise Inexpressible  # pattern, format, multipleOf, uniqueItems, propertyNames, unevaluated*, $dynamicRef, ...


def _not_types(declared) -> dict:
    names = {declared} if isinstance(declared, str) else set(declared)
    if "integer" in names and "number" not in names:
        raise Inexpressible  # a number with a fraction has no type of its own
    rest = [t for t in TYPES if t not in names and not (t == "number" and "integer" in names)]
    return {"type": rest} if rest else False


def _not_values(values: list, root):
    """Every value except these."""
    composite = distinct([v for v in values if isinstance(v, (list, dict))])
    scalars = _not_scalars([v for v in values if not isinstance(v, (list, dict))])
    return _all([scalars, *(_not_one(v, root) for v in composite)])


def _not_one(value, root):
    """Every value except this array or object: another type, another size or set of keys, or
    an item or property that differs."""
    kind = type_of(value)
    parts = [{"type": [t for t in TYPES if t != kind]}]
    if kind == "array":
        parts.append({"type": "array", "minItems": len(value) + 1})
        parts.append({"type": "array", "maxItems": len(value) - 1} if value else False)
        for i, item in enumerate(value):
            position = tuple_keywords([True] * i + [_not_values([item], root)], True, root)
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
        by_type.setdefault(type_of(value), []).append(value)
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


def _not_count(key: str, n):
    if not isinstance(n, (int, float)) or isinstance(n, bool):
        raise Inexpressible
    kind = {"Length": "string", "Items": "array", "Properties": "object"}[key[3:]]
    if not float(n).is_integer():
        raise Inexpressible  # not a valid count; leave it to the backend to refuse
    n = int(n)
    if key.startswith("min"):
        return {"type": kind, "max" + key[3:]: n - 1} if n >= 1 else False
    return {"type": kind, "min" + key[3:]: n + 1}


def _not_properties(s: dict, root, depth: int):
    """An object with a named property that breaks its schema, or, when no other key is
    allowed, with another key (an extra key breaking a schema: inexpressible)."""
    rest = s.get("additionalProperties", True)
    if s.get("patternProperties") or not (rest is False or trivial(rest)):
        raise Inexpressible
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
        raise Inexpressible
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
    if trivial_names(names):
        return False
    if names is False:
        return {"type": "object", "minProperties": 1}
    allowed = finite_values(names, root)
    if allowed is not None:
        return _key_outside([n for n in allowed if isinstance(n, str)])
    banned = banned_names(names, root)
    if banned is not None:
        return _any([{"type": "object", "required": [name]} for name in banned])
    raise Inexpressible


def _not_items(s: dict, root, depth: int):
    """An array with an item at a position that breaks its schema."""
    prefix = s.get("prefixItems") if dialect(root) >= 2020 else None  # a keyword older drafts lack
    items = s.get("items")
    if prefix is None and isinstance(items, list):  # draft 7 tuple form
        prefix, items = items, s.get("additionalItems", True)
    elif "additionalItems" in s:
        raise Inexpressible  # draft 7: additionalItems is ignored unless items is a list
    parts = []
    for i, sub in enumerate(prefix or []):
        position = {"type": "array", "minItems": i + 1, **tuple_keywords([True] * i + [negate(sub, root, depth)], True, root)}
        parts.append(position)
    rest = True if items is None else items
    if rest is False:
        parts.append({"type": "array", "minItems": len(prefix or []) + 1})
    elif rest is not True and rest != {}:
        raise Inexpressible  # "some later item breaks it" needs `contains`
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
        raise Inexpressible
    try:
        return resolve_pointer(ref, root)
    except LookupError:
        raise Inexpressible from None


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
        raise Inexpressible
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
