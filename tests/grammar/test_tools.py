"""Tool calls (grammar/tooling/tools.py): the grammar enforces calls whose arguments match their
function's schema (required, named, parallel or not, auto), refusals name the function, and the
parser reads the same calls back whole or streamed in any split."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from transformers import AutoTokenizer

from loraplex.grammar.backend import GrammarError, StructuredOutputs
from loraplex.grammar.manager import GrammarManager
from loraplex.grammar.tooling.tools import (Function, ToolCallError, ToolCallParser, ToolCalls, parse_tool_calls,
                                    plain_messages, template_takes_tools)
from test_grammar import walk

WEATHER = Function("get_weather", {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                                   "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 8},
                                                  "unit": {"enum": ["c", "f"]}}})
ADD = Function("add", {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                       "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                      "b": {"type": "integer", "minimum": 0, "maximum": 99}}})
NO_ARGS = Function("now")
TWO_CALLS = ('<tool_call>\n{"name": "add", "arguments": {"a":1,"b":2}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris","unit":"c"}}\n</tool_call>')


@pytest.fixture(scope="module")
def mgr(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return GrammarManager(tok, vocab_size=448, stop_token_ids=[tok.eos_token_id], backend="auto"), tok


def feed(manager, tok, spec, text) -> tuple[int, int, bool]:
    """Tokens of `text` the grammar accepts, of how many, and whether it may end there."""
    grammar = manager.new_grammar(manager.compile(spec))
    ids = tok.encode(text, add_special_tokens=False)
    accepted = 0
    for token in ids:
        if not grammar.accept_token(token):
            break
        accepted += 1
    return accepted, len(ids), accepted == len(ids) and grammar.accept_token(tok.eos_token_id)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("functions", [(WEATHER, ADD, NO_ARGS), (ADD,)], ids=["three", "named"])
def test_required_calls_always_carry_valid_arguments(mgr, seed, functions):
    manager, tok = mgr
    spec = StructuredOutputs(tools=ToolCalls(functions, required=True, parallel=seed % 2 == 0))
    compiled = manager.compile(spec)
    text = walk(manager, tok, spec, seed, max_steps=600)
    content, calls = parse_tool_calls(text)
    assert content is None and calls, text
    assert compiled.violation(text) is None
    schemas = {f.name: f.object_schema() for f in functions}
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    assert len(calls) == 1 or seed % 2 == 0


def test_what_each_mode_accepts(mgr):
    manager, tok = mgr
    required = StructuredOutputs(tools=ToolCalls((WEATHER, ADD), required=True))
    single = StructuredOutputs(tools=ToolCalls((WEATHER, ADD), required=True, parallel=False))
    auto = StructuredOutputs(tools=ToolCalls((WEATHER, ADD)))
    assert feed(manager, tok, required, TWO_CALLS)[2]
    accepted, total, ends = feed(manager, tok, single, TWO_CALLS)  # a second call is refused
    assert not ends and accepted < total
    assert feed(manager, tok, single, TWO_CALLS.split("\n<tool_call>")[0])[2]
    assert not feed(manager, tok, required, "Hello")[2]  # required: no text
    assert feed(manager, tok, auto, "Hello there")[2]  # auto: text is fine
    assert feed(manager, tok, auto, "Let me see. " + TWO_CALLS)[2]  # or text, then calls
    bad_args = '<tool_call>\n{"name": "add", "arguments": {"a":100,"b":2}}\n</tool_call>'
    for spec in (required, auto):  # once a call starts, its arguments follow the schema
        assert not feed(manager, tok, spec, bad_args)[2]
    assert not feed(manager, tok, auto, '<tool_call>\n{"name": "sub", "arguments": {}}\n</tool_call>')[2]


def test_refusals_name_the_function_and_strict_false_lists_what_it_dropped(mgr):
    manager, _ = mgr
    contains = {"type": "object", "properties": {"xs": {"type": "array", "contains": {"type": "integer"}}}}
    with pytest.raises(GrammarError, match=r"tool pick parameters: .*'contains' at #/properties/xs"):
        manager.compile(StructuredOutputs(tools=ToolCalls((ADD, Function("pick", contains)), required=True)))
    compiled = manager.compile(StructuredOutputs(tools=ToolCalls((Function("pick", contains, strict=False),))))
    assert compiled.unenforced == ("contains at #/properties/xs in tool pick",)
    with pytest.raises(GrammarError, match="must describe a JSON object"):
        Function("f", {"type": "array"})
    with pytest.raises(GrammarError, match="letters, digits"):
        Function("get weather")
    with pytest.raises(GrammarError, match="unique"):
        ToolCalls((ADD, ADD))
    xgrammar = GrammarManager(manager._args[0], 448, manager._args[2], backend="xgrammar")
    with pytest.raises(GrammarError, match="need the llguidance grammar backend"):
        xgrammar.compile(StructuredOutputs(tools=ToolCalls((ADD,))))


def test_the_backstop_checks_each_call_against_the_schema_as_given(mgr):
    manager, _ = mgr
    compiled = manager.compile(StructuredOutputs(tools=ToolCalls((WEATHER, ADD), required=True, parallel=False)))
    assert compiled.violation(TWO_CALLS) == "2 tool calls where one was allowed"
    assert compiled.violation("no call") == "no complete tool call"
    wrong = '<tool_call>\n{"name": "add", "arguments": {"a":1}}\n</tool_call>'
    assert "tool add arguments: 'b' is a required property" in compiled.violation(wrong)


@pytest.mark.parametrize("seed", range(5))
def test_streamed_in_any_split_the_parser_reads_what_it_reads_whole(seed):
    text = "Let me check. " + TWO_CALLS
    whole_content, whole_calls = parse_tool_calls(text)
    rng = random.Random(seed)
    parser, content, arguments, names = ToolCallParser(), "", {}, {}
    i = 0
    while i <= len(text):
        step = rng.randint(1, 7)
        piece_content, deltas = parser.feed(text[i:i + step], final=i + step >= len(text))
        content += piece_content
        assert len({d["index"] for d in deltas}) == len(deltas)  # one entry per call and chunk
        for d in deltas:
            if "id" in d:
                names[d["index"]] = d["function"]["name"]
            arguments[d["index"]] = arguments.get(d["index"], "") + d["function"]["arguments"]
        i += step
    assert content.strip() == whole_content == "Let me check."
    assert [(c.name, c.arguments) for c in whole_calls] == [(names[i], arguments[i]) for i in sorted(names)]
    assert [c.name for c in whole_calls] == ["add", "get_weather"]


def test_cut_off_calls_stay_content_and_malformed_ones_are_errors():
    assert parse_tool_calls("just text <tool_") == ("just text <tool_", [])
    cut = '<tool_call>\n{"name": "add", "arguments": {"a":1,'
    content, calls = parse_tool_calls(cut)
    assert calls == [] and content == cut
    for malformed in ("a <tool_call> b", '<tool_call>\n{"name": "add", "arguments": [1]}\n</tool_call>',
                      '<tool_call>\n{"name": "add", "arguments": {"a":1}} trailing</tool_call>'):
        with pytest.raises(ToolCallError):  # under the grammar it cannot happen: never passed off as text
            parse_tool_calls(malformed)


def test_templates_without_tools_get_them_in_the_system_message():
    assert template_takes_tools("{% if tools %}{{ tools | tojson }}{% endif %}")
    assert not template_takes_tools("{% for m in messages %}{{ m.content }}{% endfor %}")
    tools = [{"type": "function", "function": {"name": "add", "parameters": ADD.parameters}}]
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2?"},
                {"role": "assistant", "content": None, "tool_calls": [call, call]},
                {"role": "tool", "content": "3", "tool_call_id": "c1"},
                {"role": "tool", "content": "3", "tool_call_id": "c1"}]
    plain = plain_messages(messages, tools)
    assert [m["role"] for m in plain] == ["system", "user", "assistant", "user"]
    assert plain[0]["content"].startswith("Be brief.\n\n") and '"name":"add"' in plain[0]["content"]
    assert parse_tool_calls(plain[2]["content"])[1][0].arguments == '{"a": 1, "b": 2}'
    assert plain[3]["content"] == "<tool_response>\n3\n</tool_response>\n<tool_response>\n3\n</tool_response>"
