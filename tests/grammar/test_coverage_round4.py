"""Coverage round four (#65): the shapes real-world and synthesized schemas were still refused for,
served exactly (grammar/schema/rewrite.py, schema_values.py, format_patterns.py), or still refused by name.

- a node that provably admits only a few values (`allOf: [enum, not ...]`, `const` beside
  `patternProperties` / `dependencies`, `enum` beside `if` / `not`) becomes their `enum`;
- `oneOf` split by JSON type: a type two branches admit whole is out, and narrowed to one type the
  branches often show disjoint (a required key under one, no other key allowed by the other);
- `then` / `else` without `if`, and `if` without either, constrain nothing and go;
- `format: uri-reference` (RFC 3986) and `json-pointer` (RFC 6901) become the pattern of their language.

Each rewrite is checked two ways: against the `jsonschema` validator on sample values (the rewrite
admits exactly what the schema does), and compiled under `auto` with the oracle (the grammar takes
exactly the valid instances).
"""

import re

import jsonschema
import pytest
from transformers import AutoTokenizer

from loraplex.grammar.backend import StructuredOutputs
from loraplex.grammar.manager import GrammarManager
from loraplex.grammar.schema import oracle, regex_features
from loraplex.grammar.schema.format_patterns import FORMAT_PATTERNS
from loraplex.grammar.schema.formats import settle_formats
from loraplex.grammar.schema.json_schema import UnsupportedKeywordError, normalize
from loraplex.grammar.schema.rewrite import rewrite

DRAFT4 = "http://json-schema.org/draft-04/schema#"
DRAFT7 = "http://json-schema.org/draft-07/schema#"
SAMPLES = [None, True, False, 0, 1, 2, 5, 2.5, -1, "", "a", "foo", [], [1], [1, 1], {}, {"a": 1}, {"b": 2},
           {"a": 1, "b": 2}, {"firstName": "x"}, {"firstName": "x", "vehicle": "car"}, {"vehicle": "car"},
           {"vehicle": "car", "price": 3}, {"1": [1, 2], "2": [1, 2]}, {"1": [1], "2": [1, 2]}, {"5": [1, 2]}]

SHAPES = {
    # JSONSchemaBench's Synthesized split: a value, and a `not` whose negation has no schema of its own
    "an enum beside an inexpressible not": (
        {"allOf": [{"enum": ["foo", 2, 2.5]}, {"not": {"type": "integer"}}]},
        [("foo", True), (2.5, True), (2, False), (2.0, False), ("a", False)]),
    "a const beside patternProperties, not and dependencies": (
        {"type": "object", "patternProperties": {"^[0-9]$": {"type": "array", "minItems": 2}},
         "additionalProperties": False, "not": {"patternProperties": {"^(1|4)$": False}},
         "dependencies": {"5": {"not": {"required": ["3"]}}}, "const": {"1": [1, 2], "2": [1, 2]}},
        [({"1": [1, 2], "2": [1, 2]}, True), ({"1": [1], "2": [1, 2]}, False), ({"2": [1, 2]}, False)]),
    "an enum beside if / then / else and multipleOf": (
        {"type": "number", "if": {"maximum": 5}, "then": {"minimum": 5}, "else": {"minimum": 9},
         "multipleOf": 5, "not": {"multipleOf": 2}, "enum": [1, 5, 10, 15, 20]},
        [(5, True), (15, True), (10, False), (1, False), (20, False)]),
    # a real-world draft-4 schema (JSONSchemaBench Github_trivial o58627)
    "oneOf of untyped object branches": (
        {"$schema": DRAFT4, "type": "array", "items": {"oneOf": [
            {"properties": {"firstName": {"type": "string"}, "sport": {"type": "string"}}, "required": ["firstName"]},
            {"properties": {"vehicle": {"type": "string"}, "price": {"type": "integer"}},
             "additionalProperties": False}]}},
        [([{"firstName": "x"}, {"vehicle": "car", "price": 3}], True), ([{}], True), ([], True),
         ([{"firstName": "x", "vehicle": "car"}], True), (["x"], False), ([1], False), ([None], False),
         ([{"vehicle": 1}], False)]),
    "oneOf: a type one branch admits whole, the other in part": (
        {"oneOf": [{"type": ["string", "number"]}, {"type": "number", "minimum": 2}]},
        [("a", True), (1, True), (2.5, False), (2, False), (None, False)]),
    "then and else without if": (
        {"allOf": [{"if": {"exclusiveMaximum": 0}}, {"then": {"minimum": -10}}, {"else": {"multipleOf": 2}}]},
        [(-100, True), (3, True), ("x", True)]),
}


def _agrees(schema) -> None:
    rewritten = normalize(schema)
    cls = jsonschema.validators.validator_for(schema)
    for value in SAMPLES:
        assert cls(rewritten).is_valid(value) == cls(schema).is_valid(value), (value, rewritten)


@pytest.mark.parametrize("name", SHAPES)
def test_rewrites_admit_exactly_what_the_schema_does(name):
    schema, instances = SHAPES[name]
    _agrees(schema)
    cls = jsonschema.validators.validator_for(schema)
    for data, valid in instances:
        assert cls(schema).is_valid(data) == valid, ("mislabelled", data)
        assert cls(normalize(schema)).is_valid(data) == valid, data


@pytest.fixture(scope="module")
def tok(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def auto(tok):
    return GrammarManager(tok, len(tok), [tok.eos_token_id], backend="auto", timeout_s=60)


def _served(manager, tok, schema, instances) -> None:
    case = oracle.Case("round4", "", schema, [(data, valid, "") for data, valid in instances])
    outcome = oracle.check(manager, tok, case, tok.eos_token_id)
    assert outcome.status == "compiled", outcome.message
    assert not outcome.wrong, outcome.wrong


@pytest.mark.parametrize("name", SHAPES)
def test_each_shape_compiles_and_takes_exactly_its_valid_instances(auto, tok, name):
    _served(auto, tok, *SHAPES[name])


def test_a_finite_node_collapses_to_its_values_only_where_nothing_points_into_it():
    schema = {"allOf": [{"enum": ["foo"]}, {"not": {"type": "integer"}}], "title": "t"}
    assert normalize(schema) == {"enum": ["foo"], "title": "t"}
    pointed = {**schema, "properties": {"x": {"$ref": "#/allOf/0"}}}
    assert "enum" not in normalize(pointed)  # the pointer would lose its target
    assert normalize({"allOf": [{"enum": [1]}, {"not": {"const": 1}}]}) is False  # admits nothing
    # 1.0 is 1, written as a grammar writes it (outlines would emit `1.0` and take no `1`)
    assert normalize({"allOf": [{"enum": [{"a": 1.0}]}, {"not": {"enum": [{"a": True}]}}]}) == {"enum": [{"a": 1}]}


@pytest.mark.parametrize("schema", [
    {"not": {"type": "integer"}},  # a fraction has no type of its own
    {"oneOf": [{"type": "integer"}, {"minimum": 2}]},  # the numbers again: 2.5 is in one branch, 2 in both
    {"allOf": [{"enum": ["a", "b"]}, {"not": {"pattern": "^a"}}]},  # which value a pattern admits: not read
], ids=["not-integer", "oneOf-numbers", "pattern"])
def test_what_stays_inexpressible_is_still_refused_by_name(auto, schema):
    with pytest.raises(UnsupportedKeywordError):
        auto.compile(StructuredOutputs(json=schema))


def test_an_if_that_holds_a_resource_stays():
    schema = {"$ref": "http://example.com/ref/if", "if": {"$id": "http://example.com/ref/if", "type": "integer"}}
    assert "if" in normalize(schema)  # a $ref names it by its $id: dropping it would break the pointer
    # beside `unevaluated*` it counts: the keys it evaluated are evaluated (rewritten, not dropped)
    assert normalize({"if": {"properties": {"a": True}}, "unevaluatedProperties": False}) != \
        {"unevaluatedProperties": False}


# ---- formats as patterns ----

URI_REFERENCES = [
    ("http://user@[::1]:80/a/b?q=1#f", True), ("//foo.bar/?baz=qux#quux", True), ("#frag", True), ("", True),
    ("../a/b", True), ("a/b:c", True), ("mailto:x@y.z", True), ("%2F", True), ("http://[v1.x]/", True),
    ("http://[::ffff:1.2.3.4]", True), ("\\\\WINDOWS\\fileshare", False), ("#frag\\ment", False),
    ("a b", False), ("%zz", False), ("1a:b", False), ("http://[1::2::3]/", False), ("http://[::1.2.3.256]", False),
    ("http://[1:2:3:4:5:6:7:8:9]", False), ("é", False),
]


def test_uri_reference_is_rfc_3986():
    pattern = FORMAT_PATTERNS["uri-reference"]
    assert regex_features.features(pattern) == {}  # read alike by ECMA-262, Rust and Python
    for text, valid in URI_REFERENCES:
        assert bool(re.search(pattern, text)) == valid, text


def test_formats_become_their_patterns(auto, tok):
    settled, notes = settle_formats({"type": "string", "format": "uri-reference", "pattern": "^h"})
    assert notes == () and settled["pattern"] == "^h" and "format" not in settled
    strings = [("http://a/b", True), ("ftp://a", False), ("h:\\x", False)]  # the format and the own pattern both
    _served(auto, tok, {"type": "string", "format": "uri-reference", "pattern": "^h"}, strings)
    _served(auto, tok, {"type": "array", "items": {"type": "string", "format": "uri-reference"}},
            [([t], v) for t, v in URI_REFERENCES if "é" not in t][:12])
    _served(auto, tok, {"format": "json-pointer"},
            [("", True), ("/a~1b/~0/0", True), ("/", True), (3, True), ("a", False), ("/~2", False), ("/~", False)])


def test_type_split_reads_a_ref_as_replacing_its_siblings_in_older_drafts():
    schema = {"$schema": DRAFT7, "definitions": {"any": {}},
              "oneOf": [{"$ref": "#/definitions/any", "type": "string"}, {"type": "number"}]}
    rewritten = rewrite(schema)  # not normalize: the siblings are still there
    for value in (1, 2.5, "a", None, []):
        assert jsonschema.Draft7Validator(rewritten).is_valid(value) == \
            jsonschema.Draft7Validator(schema).is_valid(value), value


REVIEWED = [  # each once read wrong by a round-4 rewrite: the rewritten schema must judge every instance as jsonschema
    # a nested $id: a $ref inside resolves against it, not the root
    ({"$id": "http://x/root", "$defs": {"c": {"const": 2}}, "type": "object", "properties": {"p": {
        "$id": "http://x/b", "$defs": {"c": {"const": 1}}, "$ref": "#/$defs/c", "not": {"const": 5}}}},
     [{"p": 1}, {"p": 2}]),
    # dependentRequired's value is a map of names, not a schema
    ({"type": "object", "dependentRequired": {"const": ["a"], "allOf": []}}, [{"const": 1}, {"const": 1, "a": 2}]),
    # `dependencies` is no keyword in 2020-12
    ({"enum": [{"a": 1}, {}], "dependencies": {"a": ["b"]}, "not": {"const": 3}}, [{"a": 1}, {}]),
    ({"oneOf": [{"dependencies": {"a": ["b"]}}, {"type": "object", "required": ["a"]}]}, [{"a": 1}, {"a": 1, "b": 2}, {}]),
    # an integer past a float's range
    ({"type": "integer", "enum": [10 ** 400, 2], "not": {"const": 2}}, [10 ** 400, 2]),
    # an $anchor a $ref names
    ({"$defs": {"a": {"anyOf": [{"$anchor": "x", "const": 1}, {"const": 2}], "not": {"const": 3}}},
      "properties": {"p": {"$ref": "#x"}}}, [{"p": 1}, {"p": 2}]),
    # draft 4 defines no uri-reference: an annotation there
    ({"$schema": "http://json-schema.org/draft-04/schema#", "type": "string", "format": "uri-reference"}, ["a b", "a"]),
]


@pytest.mark.parametrize("schema,instances", REVIEWED)
def test_the_rewrite_judges_as_jsonschema_where_a_review_found_it_wrong(schema, instances):
    rewritten = normalize(schema)
    rewritten = rewritten[0] if isinstance(rewritten, tuple) else rewritten
    cls = jsonschema.validators.validator_for(schema)
    for instance in instances:
        assert cls(rewritten).is_valid(instance) == cls(schema).is_valid(instance), instance


def test_an_uppercase_ipvfuture_is_a_uri_reference():
    from loraplex.grammar.schema.format_patterns import FORMAT_PATTERNS

    assert re.fullmatch(FORMAT_PATTERNS["uri-reference"], "//[V1.x]/a")
