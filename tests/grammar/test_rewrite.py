"""The exact rewrites, checked against the jsonschema validator itself: for each schema S and
each sample value v, v is valid under the rewrite of S exactly when it is valid under S (and
under negate(S) exactly when it is not)."""

import itertools

import jsonschema
import pytest

from loraplex.grammar.schema.disjoint import disjoint
from loraplex.grammar.schema.json_schema import normalize
from loraplex.grammar.schema.rewrite import negate
from loraplex.grammar.schema.rewrite_state import Inexpressible

VALUES = [None, True, False, 0, 1, 2, 3, 2.5, -1, "", "a", "ab", "abc", "x", "xy", [], [1], [1, 2], [1, "a"],
          ["a", "b", "c"], {}, {"a": 1}, {"b": 2}, {"a": 1, "b": 2}, {"a": "s"}, {"a": 1, "c": 3}, {"k": "cat"},
          {"k": "dog", "n": 1}, {"k": "dog"}]
SCHEMAS = [
    {"type": "string"}, {"type": ["null", "number"]}, {"enum": [1, "a", None]}, {"const": "ab"}, {"const": True},
    {"minimum": 1}, {"exclusiveMaximum": 2}, {"minLength": 2}, {"maxLength": 1}, {"minItems": 1}, {"maxItems": 1},
    {"required": ["a"]}, {"required": ["a", "b"]}, {"properties": {"a": {"type": "number"}}},
    {"additionalProperties": False}, {"prefixItems": [{"type": "number"}]},
    {"prefixItems": [{"type": "number"}], "items": False}, {"contains": {"type": "string"}},
    {"anyOf": [{"type": "string"}, {"minimum": 2}]}, {"allOf": [{"type": "number"}, {"maximum": 1}]},
    {"oneOf": [{"type": "string"}, {"minimum": 2}]}, {"not": {"type": "array"}},
    {"if": {"type": "number"}, "then": {"minimum": 2}, "else": {"type": "string"}},
    {"dependentRequired": {"a": ["b"]}}, {"dependentSchemas": {"a": {"required": ["c"]}}},
    {"type": "object", "properties": {"k": {"const": "cat"}}, "required": ["k"]},
    {"type": "number", "not": {"enum": [1, 2]}}, {"type": "string", "not": {"enum": ["a", "ab", ""]}},
    {"enum": [[1], {"a": 1}]}, {"enum": [[1, 2], {"a": 1, "b": 2}, "a"]}, {"const": {"k": "dog"}},
]


def valid(value, schema) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(value)


@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda s: str(s)[:50])
def test_negation_accepts_exactly_what_the_schema_rejects(schema):
    try:
        negated = negate(schema, schema)
    except Inexpressible:
        pytest.fail(f"expected a negation of {schema}")
    for value in VALUES:
        assert valid(value, negated) != valid(value, schema), (value, negated)


@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda s: str(s)[:50])
def test_rewrites_keep_the_meaning(schema):
    for wrapped in (schema, {"not": schema}, {"oneOf": [schema, {"type": "boolean"}]}):
        rewritten = normalize(wrapped)
        try:
            negate(normalize(schema), schema)
            assert "not" not in rewritten and "oneOf" not in rewritten and "if" not in rewritten, rewritten
        except Inexpressible:  # a string complement (a pattern) cannot itself be negated again
            pass
        for value in VALUES:
            assert valid(value, rewritten) == valid(value, wrapped), (value, wrapped, rewritten)


@pytest.mark.parametrize("schema", [{"pattern": "^a"}, {"multipleOf": 2}, {"format": "email"}, {"uniqueItems": True},
                                    {"propertyNames": {"maxLength": 1}}, {"items": {"type": "string"}},
                                    {"minLength": 2.5}, {"enum": [{k: 1 for k in "abcdefgh"}]}, {"type": "integer"}])
def test_what_has_no_exact_negation_is_left_for_a_refusal(schema):
    with pytest.raises(Inexpressible):
        negate(schema, schema)
    assert "not" in normalize({"not": schema})  # the inner schema may itself be rewritten, exactly


def test_disjointness_is_never_claimed_wrongly():
    branches = [s for s in SCHEMAS if isinstance(s, dict)]
    for a, b in itertools.combinations(branches, 2):
        if disjoint([a, b]):
            assert not any(valid(v, a) and valid(v, b) for v in VALUES), (a, b)
