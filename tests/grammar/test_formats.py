"""`format` as the specification says (#51, grammar/schema/formats.py): a format JSON Schema does not define is an
annotation, served exactly with it left out and listed; OpenAPI's numeric formats are the ranges they mean;
known formats stay enforced by grammar (the oracle asserts them); strict in OpenAI's sense follows OpenAI's list
and refuses the rest by name."""

import pytest
from transformers import AutoTokenizer

from loraplex.grammar.schema import oracle
from loraplex.grammar.backend import StructuredOutputs
from loraplex.grammar.schema.formats import OPENAI_FORMATS, settle_formats
from loraplex.grammar.schema.json_schema import UnsupportedKeywordError
from loraplex.grammar.manager import GrammarManager
from loraplex.grammar.tooling.tools import Function, ToolCalls


@pytest.fixture(scope="module")
def auto(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return GrammarManager(tok, 448, [tok.eos_token_id], backend="auto"), tok


def _exactly(mgr, schema, valid, invalid, **spec):
    manager, tok = mgr
    compiled = manager.compile(StructuredOutputs(json=schema, **spec))
    for data in valid:
        assert oracle.accepts(manager, compiled, tok, data, tok.eos_token_id), data
    for data in invalid:
        assert not oracle.accepts(manager, compiled, tok, data, tok.eos_token_id), data
    return compiled


@pytest.mark.parametrize("name,valid,invalid", [
    ("int32", [0, -2**31, 2**31 - 1], [2**31, -2**31 - 1, 1.5, "1"]),
    ("int64", [0, 2**40, -2**40], [1.5, "1"]),
])
def test_openapi_integer_formats_are_their_ranges(auto, name, valid, invalid):
    compiled = _exactly(auto, {"type": "integer", "format": name}, valid, invalid)
    assert compiled.unenforced == () and "format" not in compiled.spec.json


def test_a_float_is_a_float32_range_and_a_double_any_number(auto):
    _exactly(auto, {"type": "number", "format": "float"}, [1.5, -3, 123456.75], [3.5e38, -3.5e38, "1"])
    _exactly(auto, {"type": "number", "format": "double"}, [1.5, 1e300, -7], ["1", None])
    narrower = settle_formats({"type": "integer", "format": "int32", "minimum": 5, "maximum": 2**40})[0]
    assert (narrower["minimum"], narrower["maximum"]) == (5, 2**31 - 1)  # the tighter bound of each


def test_unknown_formats_are_annotations_listed_where_they_were(auto):
    schema = {"type": "object", "required": ["u", "n"], "additionalProperties": False,
              "properties": {"u": {"type": "string", "format": "url"},
                             "n": {"type": "string", "format": "int32"},  # on a string: not a number's range
                             "t": {"type": "string", "format": "textarea"}}}
    compiled = _exactly(auto, schema, [{"u": "not a url at all", "n": "x"}, {"u": "", "n": "", "t": "free"}],
                        [{"u": 1, "n": "x"}, {"u": "a"}])
    assert [note.split(" (")[0] for note in compiled.unenforced] == [
        "format: url at #/properties/u", "format: int32 at #/properties/n", "format: textarea at #/properties/t"]


def test_known_formats_stay_enforced_or_refused_by_name(auto):
    _exactly(auto, {"type": "string", "format": "date"}, ["2024-02-29"], ["2024-13-01", "yesterday"])
    _exactly(auto, {"type": "string", "format": "uuid"}, ["123e4567-e89b-12d3-a456-426614174000"], ["123"])
    with pytest.raises(UnsupportedKeywordError, match="'format: iri'"):  # defined, no exact grammar here
        auto[0].compile(StructuredOutputs(json={"type": "string", "format": "iri"}))


@pytest.mark.parametrize("name", ["url", "int32", "uri", "iri", "textarea"])
def test_openai_strict_refuses_every_format_it_does_not_list(auto, name):
    with pytest.raises(UnsupportedKeywordError) as err:
        auto[0].compile(StructuredOutputs(json={"type": "string", "format": name}, openai_strict=True))
    assert err.value.keyword == f"format: {name}" and "OpenAI's strict mode" in str(err.value)


def test_openai_strict_serves_the_formats_it_lists(auto):
    for name in sorted(OPENAI_FORMATS):
        auto[0].compile(StructuredOutputs(json={"type": "string", "format": name}, openai_strict=True))


def test_tool_parameters_follow_the_same_rules(auto):
    schema = {"type": "object", "required": ["u"], "additionalProperties": False,
              "properties": {"u": {"type": "string", "format": "url"}}}
    lenient = auto[0].compile(StructuredOutputs(tools=ToolCalls((Function("f", schema),), "required")))
    assert lenient.unenforced[0].startswith("format: url at #/properties/u") and "in tool f" in lenient.unenforced[0]
    with pytest.raises(UnsupportedKeywordError, match="format: url"):
        auto[0].compile(StructuredOutputs(tools=ToolCalls((Function("f", schema, openai_strict=True),), "required")))
