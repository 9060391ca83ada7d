"""Refusals are final (issue 43): a spec a backend refuses for soundness never reaches a backend
that enforces less; regex features, unknown formats and metaschema-invalid keyword values are
refused by name, alike under every backend."""

import pickle

import pytest
from transformers import AutoTokenizer

from loraplex.grammar.schema import oracle, regex_features
from loraplex.grammar.backend import GrammarError, RefusedError, StructuredOutputs
from loraplex.grammar.schema.json_schema import UnsupportedKeywordError
from loraplex.grammar.manager import GrammarManager
from loraplex.grammar.tooling.tools import Function, ToolCalls

BACKENDS = ("auto", "llguidance", "xgrammar", "outlines")
# one pattern per feature, each one a backend once compiled as something else (or refused unnamed)
FEATURES = {
    "^a(?=b)$": regex_features.LOOKAHEAD, "^(?<!x)a$": regex_features.LOOKBEHIND,
    r"^(a)\1$": regex_features.BACKREFERENCE, "^(?>ab|a)b$": regex_features.ATOMIC,
    "^a*+a$": regex_features.POSSESSIVE, r"^(a)(?(1)b|c)$": regex_features.CONDITIONAL,
    r"^a\b$": regex_features.WORD_BOUNDARY, r"\Aa\Z": regex_features.ABSOLUTE_ANCHOR,
    "(?m)^a$": regex_features.MULTILINE, "(?R)": regex_features.RECURSION,
}


@pytest.fixture(scope="module")
def managers(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return {name: GrammarManager(tok, 448, [tok.eos_token_id], backend=name) for name in BACKENDS}, tok


def test_features_are_found_outside_classes_and_escapes_only():
    assert regex_features.features(r"[(?=x)\]](?!y)\(?=z") == {regex_features.LOOKAHEAD: "(?!"}
    assert regex_features.features(r"\p{Lu}+a{2,3}?\d+?(?i:x)(?P<n>y)") == {}
    assert regex_features.features("a{2}+") == {regex_features.POSSESSIVE: "{2}+"}
    assert regex_features.features("a^b$c") == {regex_features.INNER_ANCHOR: "^"}
    assert regex_features.features(r"^a\$$") == {}
    for pattern, feature in FEATURES.items():
        assert feature in regex_features.features(pattern), pattern


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pattern", list(FEATURES))
def test_each_regex_feature_is_refused_by_name_in_schemas_and_regexes(managers, backend, pattern):
    mgr = managers[0][backend]
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}},
              "required": ["s"], "additionalProperties": False}
    with pytest.raises(UnsupportedKeywordError, match=f"'pattern' at #/properties/s .*{FEATURES[pattern]}") as err:
        mgr.compile(StructuredOutputs(json=schema))
    assert err.value.keyword == "pattern" and err.value.path == "#/properties/s"
    with pytest.raises(RefusedError, match=f"regex uses a {FEATURES[pattern]}"):
        mgr.compile(StructuredOutputs(regex=pattern))


def test_the_issue_case_is_final_under_auto(managers):
    """llguidance refuses the lookahead; before, auto handed it to xgrammar, which dropped it
    and let "a" through."""
    mgr = managers[0]["auto"]
    with pytest.raises(UnsupportedKeywordError, match="llguidance.*lookahead"):
        mgr.compile(StructuredOutputs(json={"type": "string", "pattern": "^a(?=b)$"}))
    # an anchor inside a pattern: llguidance places it exactly, the others refuse it
    case = oracle.Case("pattern", "inner anchor", {"type": "string", "pattern": "^(a|b$)"},
                       [("a", True, ""), ("ab", True, ""), ("b", True, ""), ("bx", False, "")])
    tok = managers[1]
    assert (outcome := oracle.check(mgr, tok, case, tok.eos_token_id)).status == "compiled" and not outcome.wrong
    for name in ("xgrammar", "outlines"):
        with pytest.raises(UnsupportedKeywordError, match="anchor inside the pattern"):
            managers[0][name].compile(StructuredOutputs(json={"type": "string", "pattern": "a$b"}))


def test_patterns_in_property_names_are_checked_too(managers):
    schema = {"type": "object", "patternProperties": {"^x(?=y)": {"type": "integer"}}}
    with pytest.raises(UnsupportedKeywordError, match="'patternProperties' at # .*lookahead"):
        managers[0]["llguidance"].compile(StructuredOutputs(json=schema))


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_unknown_format_is_an_annotation_and_refused_under_openai_strict(managers, backend):
    """JSON Schema 2020-12: a format it does not define constrains nothing, so every backend serves the schema
    with it left out and says so; strict in OpenAI's sense refuses what OpenAI does not list, by name."""
    mgr = managers[0][backend]
    schema = {"type": "object", "additionalProperties": False, "required": ["d"],
              "properties": {"d": {"type": "string", "format": "banana"}}}
    if backend != "outlines":  # outlines takes no open string: its grammar is a regex of listed properties
        for strict in (True, False):
            compiled = mgr.compile(StructuredOutputs(json=schema, strict=strict))
            assert compiled.unenforced == ("format: banana at #/properties/d (an annotation: a format JSON Schema "
                                           "does not define constrains nothing)",)
            assert "format" not in compiled.spec.json["properties"]["d"]
            assert compiled.original == schema  # the output is checked against the schema as given
    with pytest.raises(UnsupportedKeywordError) as err:
        mgr.compile(StructuredOutputs(json=schema, openai_strict=True))
    assert (err.value.keyword, err.value.path) == ("format: banana", "#/properties/d")
    assert "not one of the formats OpenAI's strict mode supports" in str(err.value)


def test_a_format_the_first_backend_lacks_is_not_handed_on(managers):
    """llguidance has no grammar for idn-email; xgrammar would let any string through."""
    with pytest.raises(UnsupportedKeywordError, match="'format: idn-email' at # .*llguidance"):
        managers[0]["auto"].compile(StructuredOutputs(json={"type": "string", "format": "idn-email"}))
    with pytest.raises(UnsupportedKeywordError, match="'format: uri' at # .*OpenAI's strict mode"):
        managers[0]["auto"].compile(StructuredOutputs(json={"type": "string", "format": "uri"}, openai_strict=True))


def test_a_backend_that_cannot_build_a_spec_lets_the_next_one_try(managers):
    """Not a refusal: xgrammar has no syntax for \\p{..}, outlines enforces it exactly."""
    xgrammar = GrammarManager(managers[1], 448, [managers[1].eos_token_id], backend="xgrammar")
    with pytest.raises(GrammarError) as err:
        xgrammar.compile(StructuredOutputs(regex=r"\p{Lu}x"))
    assert not isinstance(err.value, RefusedError)


@pytest.mark.parametrize("schema,path,fragment", [
    ({"type": "string", "minLength": "5"}, "#/minLength", "'5' is not of type 'integer'"),
    ({"type": "object", "properties": {"s": {"type": "string", "maxLength": -3}}}, "#/properties/s/maxLength",
     "less than the minimum of 0"),
    ({"type": "number", "multipleOf": -1}, "#/multipleOf", "less than or equal to the minimum of 0"),
    ({"type": "array", "items": {"type": "strnig"}}, "#/items/type", "is not valid"),
])
@pytest.mark.parametrize("backend", BACKENDS)
def test_metaschema_invalid_keyword_values_are_refused_naming_the_path(managers, schema, path, fragment, backend):
    with pytest.raises(GrammarError, match=f"json schema is invalid at {path}: .*{fragment}"):
        managers[0][backend].compile(StructuredOutputs(json=schema))


def test_tool_parameters_are_checked_against_the_metaschema_too(managers):
    calls = ToolCalls((Function("f", parameters={"type": "object", "properties": {"n": {"type": "integer",
                                                                                      "minimum": "0"}}}),))
    with pytest.raises(GrammarError, match="tool f parameters: the parameters schema is invalid at "
                                           "#/properties/n/minimum"):
        managers[0]["auto"].compile(StructuredOutputs(tools=calls))


def test_refusals_cross_a_process_whole():
    refused = UnsupportedKeywordError("why", "pattern", "#/a")
    back = pickle.loads(pickle.dumps(refused))
    assert (type(back), str(back), back.keyword, back.path) == (UnsupportedKeywordError, "why", "pattern", "#/a")


@pytest.mark.parametrize("schema,keyword", [
    ({"type": "object", "allOf": [{"type": "object", "patternProperties": {"a": {"type": "number", "minimum": 10}}},
                                  {"type": "object", "patternProperties": {"b": {"type": "number", "minimum": 3}}}]},
     "patternProperties"),
    ({"type": "string", "pattern": "^([a-z][0-9])+$", "minLength": 10000}, "pattern"),
    ({"$ref": "#/definitions/n", "definitions": {"n": {"type": "object", "description": "a tree",
                                                       "properties": {"next": {"$ref": "#/definitions/n",
                                                                               "description": "again"}}}}}, None),
])
def test_what_llguidance_cannot_build_is_refused_by_name(managers, schema, keyword):
    """#51: llguidance's own limits (overlapping patternProperties, patterns too complex to prove satisfiable)
    were reported as compile errors; now each names its keyword (no backend after it enforces more)."""
    if keyword is None:  # a recursive schema whose $ref has annotation siblings: built, not refused
        managers[0]["auto"].compile(StructuredOutputs(json=schema))
        return
    with pytest.raises(UnsupportedKeywordError) as err:
        managers[0]["auto"].compile(StructuredOutputs(json=schema))
    assert err.value.keyword == keyword


def test_a_schema_that_admits_nothing_says_so(managers):
    schema = {"type": "object", "required": ["d"], "properties": {"d": {
        "type": "object", "required": ["x", "y"], "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
        "oneOf": [{"required": ["x"]}, {"required": ["y"]}]}}}  # both present: both branches hold, never one
    for backend in ("llguidance", "auto"):
        with pytest.raises(GrammarError, match="unsatisfiable: it admits no value"):
            managers[0][backend].compile(StructuredOutputs(json=schema))
