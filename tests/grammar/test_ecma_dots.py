"""`.` in a JSON Schema `pattern` (or a `patternProperties` name) as ECMA-262 says: any
character but a line terminator (\\n, \\r, U+2028, U+2029). llguidance's own `.` lets \\r and
U+2028 / U+2029 through, so its backend writes each `.` out first (grammar/schema/ecma_regex.py)."""

import pytest
from transformers import AutoTokenizer

from loraplex.grammar.schema import oracle
from loraplex.grammar.backend import StructuredOutputs
from loraplex.grammar.compiler import json_validator
from loraplex.grammar.schema.ecma_regex import exact_dots
from loraplex.grammar.backends.llguidance_backend import ecma_dots
from loraplex.grammar.manager import GrammarManager

BREAKS = ["\r", "\n", "\u2028", "\u2029"]


@pytest.fixture(scope="module")
def llg(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return GrammarManager(tok, 448, [tok.eos_token_id], backend="llguidance"), tok


def _exactly(mgr, schema, valid, invalid):
    manager, tok = mgr
    validator = json_validator(schema)
    compiled = manager.compile(StructuredOutputs(json=schema))
    for data in valid:
        assert validator.is_valid(data), ("mislabelled", data)
        assert oracle.accepts(manager, compiled, tok, data, tok.eos_token_id), data
    for data in invalid:
        assert oracle.accepts(manager, compiled, tok, data, tok.eos_token_id) is False, data


def test_a_dot_in_a_pattern_takes_no_line_terminator(llg):
    _exactly(llg, {"type": "string", "pattern": "^a.b$"},
             ["axb", "a b", "a\tb", "a.b"], [f"a{c}b" for c in BREAKS] + ["ab", "axxb"])


def test_a_dot_in_a_class_is_a_dot_and_an_escaped_dot_stays_escaped(llg):
    _exactly(llg, {"type": "string", "pattern": "^a[.]b$"}, ["a.b"], ["axb", "a\rb"])
    _exactly(llg, {"type": "string", "pattern": "^a\\.b$"}, ["a.b"], ["axb", "a\rb"])
    _exactly(llg, {"type": "string", "pattern": "^a\\..$"}, ["a.x"], ["a.\r", "a.\u2028", "ax."])


def test_a_dot_in_a_pattern_property_name_takes_no_line_terminator(llg):
    schema = {"type": "object", "patternProperties": {"^k.$": {"type": "integer"}},
              "additionalProperties": False}
    _exactly(llg, schema, [{}, {"kx": 1}], [{"kx": "1"}] + [{f"k{c}": 1} for c in BREAKS])


def test_nested_patterns_are_written_out_in_a_copy():
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "x.y[.]\\."}},
              "patternProperties": {"^p.": {"items": {"pattern": "^.$"}}}, "$defs": {"d": {"pattern": "[a.]"}}}
    before = repr(schema)
    out = ecma_dots(schema)
    assert repr(schema) == before  # the request's own schema is left alone
    assert out["properties"]["a"]["pattern"] == "x" + exact_dots(".") + "y[.]\\."
    assert list(out["patternProperties"]) == ["^p" + exact_dots(".")]
    assert out["patternProperties"]["^p" + exact_dots(".")]["items"]["pattern"] == "^" + exact_dots(".") + "$"
    assert out["$defs"]["d"]["pattern"] == "[a.]"
    assert exact_dots(".") == "[^\\n\\r\\u2028\\u2029]"
