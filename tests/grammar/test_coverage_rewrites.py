"""Coverage round three: `oneOf`, `uniqueItems` and `propertyNames` served exactly where that is
possible (grammar/schema/rewrite.py), and still refused by name where it is not.

For each rule: the rewrite is applied (the keyword is gone after `normalize`), the result
compiles under `auto`, and the oracle (grammar/schema/oracle.py) finds the grammar accepting exactly the
valid instances of hand-written cases. Each case's labels are first checked against the
`jsonschema` validator, except the few marked ECMA, where Python's regex engine (which the
validator uses) reads a pattern otherwise than ECMA-262, the dialect JSON Schema names.
"""

import itertools

import jsonschema
import pytest
from transformers import AutoTokenizer

from loraplex.grammar.schema import oracle
from loraplex.grammar.backend import StructuredOutputs
from loraplex.grammar.compiler import json_validator
from loraplex.grammar.schema.disjoint import disjoint
from loraplex.grammar.schema.finite_keywords import MAX_UNIQUE_BRANCHES
from loraplex.grammar.schema.json_schema import UnsupportedKeywordError, normalize
from loraplex.grammar.manager import GrammarManager

DRAFT7 = "http://json-schema.org/draft-07/schema#"
DRAFT4 = "http://json-schema.org/draft-04/schema#"
ECMA = "ECMA"  # a label the Python validator would not give: only ECMA-262 semantics decide it


@pytest.fixture(scope="module")
def tok(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def auto(tok):
    return GrammarManager(tok, len(tok), [tok.eos_token_id], backend="auto", timeout_s=60)


def exactly(manager, tok, schema, instances, gone: str) -> None:
    """`gone` is rewritten away, the schema compiles, and the grammar takes exactly the valid instances."""
    assert gone not in str(normalize(schema)), normalize(schema)
    validator = json_validator(schema)
    for data, valid, *note in instances:
        if not note:
            assert validator.is_valid(data) == valid, ("mislabelled", data)
    case = oracle.Case("coverage", gone, schema, [(data, valid, "") for data, valid, *_ in instances])
    outcome = oracle.check(manager, tok, case, tok.eos_token_id)
    assert outcome.status == "compiled", outcome.message
    assert not outcome.wrong, outcome.wrong


def refused(manager, schema, keyword: str) -> None:
    with pytest.raises(UnsupportedKeywordError) as caught:
        manager.compile(StructuredOutputs(json=schema))
    assert caught.value.keyword == keyword, str(caught.value)


# ---- oneOf ----

REQUEST = {"type": "object", "required": ["jsonrpc", "method"], "additionalProperties": False,
           "properties": {"jsonrpc": {"enum": ["2.0"]}, "method": {"type": "string"},
                          "id": {"type": ["string", "null"]}}}
ONE_OF = {
    "refs to an object and an array": (
        {"$schema": DRAFT4, "definitions": {"request": REQUEST},
         "oneOf": [{"$ref": "#/definitions/request"},
                   {"type": "array", "items": {"$ref": "#/definitions/request"}, "minItems": 1}]},
        [({"jsonrpc": "2.0", "method": "a"}, True), ([{"jsonrpc": "2.0", "method": "a", "id": None}], True),
         ([], False), ({"jsonrpc": "1.0", "method": "a"}, False), ("x", False)]),
    "constants beside a type": (
        {"type": "number", "oneOf": [{"const": 1, "standsFor": "chars"}, {"const": 2}, {"const": 3.5}]},
        [(1, True), (2.0, True), (3.5, True), (4, False), (1.5, False), ("1", False)]),
    "overlapping sets of arrays by $ref": (
        {"type": "array", "definitions": {"x": {"enum": [[1], [3, 4], [5]]}, "y": {"enum": [[1], [1, 2]]},
                                          "z": {"enum": [[5], [6]]}},
         "oneOf": [{"$ref": "#/definitions/x"}, {"$ref": "#/definitions/y"}, {"$ref": "#/definitions/z"}]},
        [([3, 4], True), ([1, 2], True), ([6], True), ([1], False), ([5], False), ([1.0], False), ([7], False)]),
    "a discriminator whose values sit in $ref'd definitions": (
        {"$defs": {"cat": {"type": "object", "required": ["kind"],
                           "properties": {"kind": {"$ref": "#/$defs/catKind"}, "lives": {"type": "integer"}}},
                   "dog": {"type": "object", "required": ["kind"],
                           "properties": {"kind": {"enum": ["dog", "wolf"]}, "lives": {"type": "string"}}},
                   "catKind": {"const": "cat"}},
         "oneOf": [{"$ref": "#/$defs/cat"}, {"$ref": "#/$defs/dog"}]},
        [({"kind": "cat", "lives": 9}, True), ({"kind": "wolf", "lives": "x"}, True), ({"kind": "bird"}, False),
         ({"kind": "cat", "lives": "x"}, False), ({"lives": 1}, False), ([], False)]),
    "strings told apart by their values": (
        {"oneOf": [{"enum": ["a", "bb"]}, {"type": "string", "maxLength": 1, "not": {"const": "a"}}]},
        [("a", True), ("bb", True), ("c", True), ("", True), ("cc", False), (1, False)]),
    "a null branch beside an untyped one": (
        {"oneOf": [{"type": "null"}, {"properties": {"a": {"type": "string"}}}]},
        [(None, False), ({"a": "x"}, True), ({"a": 1}, False), (3, True)]),
    "ranges that do not meet": (
        {"oneOf": [{"type": "number", "maximum": 0}, {"type": "number", "exclusiveMinimum": 0, "maximum": 5},
                   {"type": "integer", "minimum": 6}]},
        [(0, True), (0.5, True), (-3, True), (5, True), (6, True), (5.5, False), ("x", False)]),
    "ranges that meet at a point": (
        {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 10}, {"type": "integer", "minimum": 10}]},
        [(5, True), (11, True), (10, False), (-1, False)]),
    "type lists": (
        {"oneOf": [{"type": ["string", "null"]}, {"type": ["number", "boolean"]}]},
        [("a", True), (None, True), (1, True), (True, True), ([], False), ({}, False)]),
    "a required key the other forbids": (
        {"type": "object", "oneOf": [{"required": ["a"]}, {"properties": {"a": False}, "required": ["b"]}]},
        [({"a": 1}, True), ({"b": 1}, True), ({"a": 1, "b": 1}, True), ({}, False)]),
}


@pytest.mark.parametrize("name", ONE_OF)
def test_oneof_is_served_exactly(auto, tok, name):
    schema, instances = ONE_OF[name]
    exactly(auto, tok, schema, instances, "oneOf")


@pytest.mark.parametrize("schema", [
    {"oneOf": [{"type": "integer"}, {"type": "number"}]},  # 1 is both; a fraction has no schema of its own
    {"oneOf": [{"type": "string", "pattern": "^a"}, {"type": "string", "pattern": "b$"}]},
    {"oneOf": [{"type": "object", "required": ["a"]},
               {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}}}}]},
], ids=["integer-number", "patterns", "items"])
def test_oneof_that_overlaps_inexpressibly_is_still_refused(auto, schema):
    refused(auto, schema, "oneOf")


SAMPLES = [None, True, False, 0, 1, 1.0, 2.5, 5, 10, -1, "", "a", "b", "ab", [], [1], [1, 2], [[1]], {}, {"a": 1},
           {"a": "x"}, {"b": 1}, {"k": "cat"}, {"k": "dog"}, {"k": "cat", "a": 1}]
ROOT = {"$defs": {"cat": {"type": "object", "required": ["k"], "properties": {"k": {"const": "cat"}}},
                  "anyK": {"type": "object", "required": ["k"]}, "num": {"type": "number", "maximum": 1},
                  "pair": {"enum": [[1, 2], "ab"]}, "named": {"$ref": "#/$defs/cat"}}}
BRANCHES = [{"$ref": "#/$defs/cat"}, {"$ref": "#/$defs/anyK"}, {"$ref": "#/$defs/num"}, {"$ref": "#/$defs/pair"},
            {"$ref": "#/$defs/named"}, {"allOf": [{"$ref": "#/$defs/num"}, {"minimum": 0}]},
            {"properties": {"k": {"const": "dog"}}, "required": ["k"]}, {"type": "number", "exclusiveMinimum": 1},
            {"type": "integer", "minimum": 1}, {"type": ["array", "string"], "minLength": 2}, {"enum": [1, "a"]},
            {"const": 1.0}, {"type": "object", "properties": {"k": False}}, {"not": {"type": "string"}},
            {"type": "string", "pattern": "^a"}, {"minimum": 2}, {"maxItems": 1}, {"type": "null"}, False, True]


def test_disjointness_is_never_claimed_wrongly():
    validator = lambda branch: jsonschema.Draft202012Validator({**ROOT, "allOf": [branch]})  # noqa: E731
    claimed = 0
    for a, b in itertools.combinations(BRANCHES, 2):
        if disjoint([a, b], ROOT):
            claimed += 1
            both = [v for v in SAMPLES if validator(a).is_valid(v) and validator(b).is_valid(v)]
            assert not both, (a, b, both)
    assert claimed > 60  # the proof is not vacuous


def test_a_ref_replaces_its_siblings_in_older_drafts():
    root = {"$schema": DRAFT7, "definitions": {"any": {}}}
    branches = [{"$ref": "#/definitions/any", "type": "string"}, {"type": "number"}]
    assert not disjoint(branches, root)  # under draft 7 the first branch admits everything
    assert disjoint(branches, {**root, "$schema": "https://json-schema.org/draft/2020-12/schema"})


# ---- uniqueItems ----

UNIQUE = {
    "numbers, 1 and 1.0 equal": (
        {"type": "array", "items": {"enum": [1, 2, 3]}, "uniqueItems": True},
        [([], True), ([1], True), ([3, 1, 2], True), ([2, 3], True), ([1, 1], False), ([1, 1.0], False),
         ([1, 2, 1], False), ([4], False), (["1"], False), ("x", False)]),
    "booleans, maxItems above what there is": (
        {"type": "array", "items": {"type": "boolean"}, "uniqueItems": True, "maxItems": 5},
        [([True, False], True), ([False], True), ([], True), ([True, True], False), ([True, False, True], False)]),
    "one value, at least one item": (
        {"type": "array", "items": {"const": "x"}, "uniqueItems": True, "minItems": 1},
        [(["x"], True), ([], False), (["x", "x"], False), (["y"], False)]),
    "an enum with equal members, and objects": (
        {"type": "array", "items": {"enum": [1, 1.0, {"a": 1}, {"a": 1.0}, None]}, "uniqueItems": True},
        [([1, {"a": 1}, None], True), ([{"a": 1}, 1], True), ([{"a": 1}, {"a": 1.0}], False), ([None, None], False)]),
    "no type: other values pass": (
        {"items": {"enum": ["a", "b"]}, "uniqueItems": True},
        [("str", True), (5, True), ({"a": 1}, True), (["b", "a"], True), (["a", "a"], False), (["c"], False)]),
    "draft 7: a tuple is an items list": (
        {"$schema": DRAFT7, "type": "array", "items": {"enum": ["a", "b"]}, "uniqueItems": True},
        [(["b", "a"], True), ([], True), (["a", "a"], False), (["c"], False), (["a", "b", "a"], False)]),
    "draft 4: a value is an enum": (
        {"$schema": DRAFT4, "type": "array", "items": {"type": "boolean"}, "uniqueItems": True},
        [([True], True), ([False, True], True), ([True, True], False), ([1], False)]),
    "inside a not": (
        {"type": "array", "not": {"items": {"enum": [1, 2]}, "uniqueItems": True}},
        [([1, 1], True), ([3], True), ([1, 2, 1], True), ([], False), ([1], False), ([2, 1], False)]),
    "beside a oneOf": (
        {"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True, "oneOf": [{"minItems": 2}, {"maxItems": 0}]},
        [([1, 2], True), ([2, 1], True), ([], True), ([1], False), ([1, 1], False)]),
    "false is no constraint": (
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": False},
        [([1, 1], True), ([], True), (["a"], False)]),
}


@pytest.mark.parametrize("name", UNIQUE)
def test_unique_items_over_a_finite_set_is_served_exactly(auto, tok, name):
    schema, instances = UNIQUE[name]
    exactly(auto, tok, schema, instances, "uniqueItems")


def test_unique_items_branches_are_capped():
    assert MAX_UNIQUE_BRANCHES >= 65  # four values, every selection
    four = normalize({"type": "array", "items": {"enum": [1, 2, 3, 4]}, "uniqueItems": True})
    assert "uniqueItems" not in four and len(four["anyOf"]) == 65


@pytest.mark.parametrize("schema", [
    {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
    {"type": "array", "items": {"enum": list(range(10))}, "uniqueItems": True},  # too many selections
    {"type": "array", "uniqueItems": True},
    {"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True, "minItems": 3},  # more than there is
    {"type": "array", "prefixItems": [{"const": 1}], "items": {"enum": [1, 2]}, "uniqueItems": True, "minItems": 1},
], ids=["strings", "too-many", "no-items", "unsatisfiable", "prefix"])
def test_unique_items_without_a_small_domain_is_still_refused(auto, schema):
    refused(auto, schema, "uniqueItems")


# ---- propertyNames ----

NAMES = {
    "a pattern, with named properties": (
        {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"},
         "properties": {"ab": {"type": "integer"}, "Bad": {"type": "string"}}},
        [({"ab": 1}, True), ({"ab": "x"}, False), ({"cd": "any"}, True), ({"Bad": "x"}, False), ({"aB": 1}, False),
         ({"": 1}, False), ({}, True), ({"ab": 1, "x1": 2}, False)]),
    "an unanchored pattern": (
        {"type": "object", "propertyNames": {"pattern": "a", "type": "string"}},
        [({"bab": 1}, True), ({"a": 1, "xa": 2}, True), ({"b": 1}, False), ({"b\na": 1}, True), ({"A": 1}, False)]),
    "a dot and an end anchor, as ECMA-262 reads them": (
        {"type": "object", "propertyNames": {"pattern": "^.$"}},
        [({"x": 1}, True), ({"é": 1}, True), ({"xy": 1}, False), ({"\r": 1}, False, ECMA),
         ({"\u2028": 1}, False, ECMA), ({"x\n": 1}, False, ECMA)]),
    "escapes and classes": (
        {"type": "object", "propertyNames": {"pattern": "^x-\\d{2}[._]?$"}, "properties": {"x-12": {"const": 1}}},
        [({"x-12": 1}, True), ({"x-12": 2}, False), ({"x-34.": 0}, True), ({"x-3": 1}, False), ({"x-1a": 1}, False)]),
    "a set of names": (
        {"type": "object", "propertyNames": {"enum": ["a", "b", 3]}, "required": ["a"],
         "properties": {"a": {"type": "integer"}, "c": {"type": "string"}},
         "additionalProperties": {"type": "boolean"}},
        [({"a": 1, "b": True}, True), ({"a": 1}, True), ({"a": 1, "b": 1}, False), ({"a": 1, "c": "x"}, False),
         ({"b": True}, False), ({"a": 1, "3": True}, False)]),
    "a name by $ref": (
        {"type": "object", "$defs": {"names": {"const": "id"}}, "propertyNames": {"$ref": "#/$defs/names"}},
        [({"id": [1]}, True), ({}, True), ({"id": 1, "x": 1}, False), ({"ID": 1}, False)]),
    "names that are not allowed": (
        {"type": "object", "propertyNames": {"not": {"enum": ["x", "y"]}}, "properties": {"x": {"type": "integer"}}},
        [({"z": 1}, True), ({"xx": 1}, True), ({"x": 1}, False), ({"y": "s"}, False), ({}, True)]),
    "false: only the empty object": (
        {"type": "object", "propertyNames": False, "properties": {"a": {}}},
        [({}, True), ({"a": 1}, False), ({"b": 1}, False)]),
    "lengths": (
        {"type": "object", "propertyNames": {"maxLength": 2, "minLength": 1}},
        [({"ab": 1}, True), ({"abc": 1}, False), ({"😀😀": 1}, True), ({"": 1}, False)]),
    "with no other keys allowed": (
        {"type": "object", "propertyNames": {"pattern": "^a"}, "additionalProperties": False,
         "properties": {"ab": {"type": "integer"}, "b": {"type": "integer"}}},
        [({"ab": 1}, True), ({"b": 1}, False), ({"ac": 1}, False), ({}, True)]),
    "negated: a key that must be there": (
        {"type": "object", "not": {"propertyNames": {"not": {"const": "0"}}}},
        [({"0": 1}, True), ({"0": 1, "1": 2}, True), ({"1": 1}, False), ({}, False)]),
    "negated: some key outside the set": (
        {"type": "object", "not": {"propertyNames": {"enum": ["a", "b"]}}},
        [({"c": 1}, True), ({"a": 1, "c": 1}, True), ({"a": 1, "b": 2}, False), ({}, False)]),
    "negated false: not empty": (
        {"type": "object", "not": {"propertyNames": False}},
        [({"c": 1}, True), ({}, False)]),
}


@pytest.mark.parametrize("name", NAMES)
def test_property_names_are_served_exactly(auto, tok, name):
    schema, instances = NAMES[name]
    exactly(auto, tok, schema, instances, "propertyNames")


def test_a_pattern_feature_is_refused_by_name_before_any_rewrite(auto):
    refused(auto, {"type": "object", "propertyNames": {"pattern": "^(?!x)"}}, "pattern")  # a lookahead


@pytest.mark.parametrize("schema", [
    {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}, "additionalProperties": {"type": "integer"}},
    {"type": "object", "propertyNames": {"pattern": "^a"}, "patternProperties": {"b": {"type": "integer"}}},
    {"type": "object", "propertyNames": {"pattern": "^a", "maxLength": 3}},
    {"type": "object", "propertyNames": {"pattern": "^a"}, "required": ["b"]},  # unsatisfiable
    {"type": "object", "propertyNames": {"pattern": "^\\p{L}+$"}},  # a class Python reads otherwise
    {"type": "object", "propertyNames": {"pattern": "^a"}, "properties": {"é": {}}},  # a key beyond ASCII
    {"type": "object", "propertyNames": {"format": "email"}},
], ids=["additional-schema", "pattern-properties", "pattern-and-length", "required-unmatched",
        "unicode-class", "non-ascii-key", "format"])
def test_property_names_without_an_exact_form_are_still_refused(auto, schema):
    refused(auto, schema, "propertyNames")


def test_trivial_names_and_unique_false_are_dropped_on_the_light_path_too():
    light = normalize({"type": "object", "propertyNames": {"type": "string"},
                       "properties": {"a": {"type": "array", "uniqueItems": False}}}, deep=False)
    assert light == {"type": "object", "properties": {"a": {"type": "array"}}}


@pytest.mark.parametrize("schema, keyword", [
    ({"type": "object", "properties": {"a": {"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True},
                                       "b": {"$ref": "#/properties/a/items"}}}, "uniqueItems"),
    ({"type": "object", "propertyNames": {"enum": ["a"]}, "properties": {"a": {"$ref": "#/properties/b"},
                                                                         "b": {"type": "integer"}}}, "propertyNames"),
], ids=["items", "removed-property"])
def test_a_rewrite_never_removes_what_a_ref_points_at(auto, schema, keyword):
    refused(auto, schema, keyword)


# ---- negations the rewrites above lean on, in each dialect ----

NEGATIONS = {
    "arrays and objects excluded one by one": (
        {"not": {"enum": [[1, 2], {"a": 1, "b": [True]}, "s"]}},
        [([1, 2], False), ([1, 2.0], False), ([2, 1], True), ([1], True), ([1, 2, 3], True),
         ({"a": 1, "b": [True]}, False),
         ({"b": [True], "a": 1.0}, False), ({"a": 1}, True), ({"a": 1, "b": [False]}, True),
         ({"a": 1, "b": [True], "c": 0}, True), ("s", False), ("t", True), (None, True)]),
    "a double negation, read as given": (
        {"allOf": [{"enum": [{"a": "x"}, 2]}, {"not": {"not": {"enum": [{"a": "x"}]}}}]},
        [({"a": "x"}, True), ({"a": "x", "b": 1}, False), (2, False)]),
    "a closed object, negated": (
        {"type": "object", "not": {"properties": {"a": {"type": "string"}}, "additionalProperties": False}},
        [({"a": "x"}, False), ({}, False), ({"a": 1}, True), ({"b": 1}, True), ({"a": "x", "b": 1}, True)]),
    "draft 7: a negated tuple is an items list": (
        {"$schema": DRAFT7, "type": "array", "not": {"items": [{"type": "string"}]}},
        [(["a"], False), ([1], True), ([], False), (["a", 1], False), ([1, "a"], True)]),
    "draft 4: a negated boolean is an enum": (
        {"$schema": DRAFT4, "not": {"enum": [True]}},
        [(True, False), (False, True), (1, True)]),
    "draft 4: const constrains nothing": (
        {"$schema": DRAFT4, "type": "integer", "not": {"const": 1}},
        [(1, False), (2, False)]),
}


@pytest.mark.parametrize("name", NEGATIONS)
def test_negations_are_exact_in_each_dialect(auto, tok, name):
    schema, instances = NEGATIONS[name]
    validator = json_validator(schema)
    assert all(validator.is_valid(data) == valid for data, valid in instances)
    case = oracle.Case("negation", name, schema, [(data, valid, "") for data, valid in instances])
    outcome = oracle.check(auto, tok, case, tok.eos_token_id)
    if any(valid for _, valid in instances):
        assert outcome.status == "compiled", outcome.message
    else:  # nothing is valid: a backend may find the schema unsatisfiable
        assert outcome.status in ("compiled", "error"), outcome.message
    assert not outcome.wrong, outcome.wrong
