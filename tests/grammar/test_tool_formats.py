"""Every tool-call format (grammar/tooling/tool_formats.py): the grammar writes calls its reader reads
back and whose arguments validate (plain markers and markers held as special tokens), `auto`
recognizes the format in a chat template, the reader takes hand-written outputs whole or in any
split, a malformed call is an error, a cut-off one content, and what a format cannot write is
refused by name."""

from __future__ import annotations

import json
import random
import shutil

import jsonschema
import pytest
from tokenizers import AddedToken
from transformers import AutoTokenizer

from loraplex.grammar.backend import GrammarError, StructuredOutputs
from loraplex.grammar.manager import GrammarManager
from loraplex.grammar.tooling.tools import (FORMATS, Function, ToolCallError, ToolCallParser, ToolCalls, lark_rules,
                                    parse_tool_calls, resolve)
from test_grammar import walk

WEATHER = Function("get_weather", {"type": "object", "additionalProperties": False, "required": ["city"],
                                   "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 8},
                                                  "unit": {"enum": ["c", "f"]}, "days": {"type": "integer",
                                                                                         "minimum": 1, "maximum": 5}}})
ADD = Function("add", {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                       "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "boolean"}}})
NOW = Function("now")
SCHEMAS = {f.name: f.object_schema() for f in (WEATHER, ADD, NOW)}
MARKERS = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>"]


@pytest.fixture(scope="module", params=["text", "tokens"])
def mgr(request, tiny_model_dir, tmp_path_factory):
    """The tiny tokenizer as it is (markers spelled out in text), and with each marker one token
    (`<tool_call>` added like Qwen's, the others special)."""
    folder = tiny_model_dir
    if request.param == "tokens":
        folder = tmp_path_factory.mktemp("marker-tokens")
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tiny_model_dir / name, folder / name)
        tok = AutoTokenizer.from_pretrained(folder)
        tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in MARKERS[:2]])
        tok.add_tokens([AddedToken(m, special=True, normalized=False) for m in MARKERS[2:]], special_tokens=True)
        tok.save_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    return GrammarManager(tok, vocab_size=448, stop_token_ids=[tok.eos_token_id], backend="auto"), tok


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("seed", range(3))
def test_required_calls_in_each_format_read_back_valid(mgr, fmt, seed):
    manager, tok = mgr
    spec = StructuredOutputs(tools=ToolCalls((WEATHER, ADD, NOW), required=True, parallel=seed != 1, format=fmt))
    compiled = manager.compile(spec)
    text = walk(manager, tok, spec, seed, max_steps=600)
    content, calls = parse_tool_calls(text, fmt)
    assert content is None and calls, text
    assert len(calls) == 1 or seed != 1
    assert compiled.violation(text) is None
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_markers_held_as_tokens_are_written_as_those_tokens(mgr):
    manager, tok = mgr
    backend = manager._get("llguidance")
    rules = "\n".join(lark_rules(ToolCalls((ADD,), format="mistral"), backend.markers))
    special = tok.convert_tokens_to_ids("[TOOL_CALLS]") if "[TOOL_CALLS]" in tok.get_vocab() else None
    assert (f"<[{special}]>" in rules) == (special is not None)
    assert ('"[TOOL_CALLS]"' in rules) == (special is None)


# ---- the reader on hand-written outputs -------------------------------------------------------------

ADD_1_2, PARIS = ("add", {"a": 1, "b": True}), ("get_weather", {"city": "Paris", "unit": "c"})
WRITTEN = [  # (format, output, content, calls)
    ("hermes", 'Let me see. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": true}}\n</tool_call>\n'
               '<tool_call>{"name":"get_weather","arguments":{"city":"Paris","unit":"c"}}</tool_call>',
     "Let me see.", [ADD_1_2, PARIS]),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1, "b": true}}; '
                    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}', None, [ADD_1_2, PARIS]),
    ("llama3_json", '<|python_tag|>{"name":"add","parameters":{"a":1,"b":true}}', None, [ADD_1_2]),
    ("llama3_json", 'It is {"name": "add"} they say', 'It is {"name": "add"} they say', []),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": true}}, '
                '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}]', "Sure.", [ADD_1_2, PARIS]),
    ("mistral_v11", '[TOOL_CALLS]add[ARGS]{"a": 1, "b": true}[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", '
                    '"unit": "c"}', None, [ADD_1_2, PARIS]),
    ("pythonic", '[add(a=1, b=True), get_weather(city="Paris", unit=\'c\')]', None, [ADD_1_2, PARIS]),
    ("pythonic", '[add(a=1, b=true)]', None, [ADD_1_2]),  # JSON's spelling, as the grammar writes values
    ("pythonic", "[f(xs=[1, 'a', None], d={'k': false}, neg=-2.5, s=\"\\u00e9\\/\")]", None,
     [("f", {"xs": [1, "a", None], "d": {"k": False}, "neg": -2.5, "s": "é/"})]),
    ("pythonic", "I would [not] call anything", "I would [not] call anything", []),
]


def _read(fmt: str, text: str):
    content, calls = parse_tool_calls(text, fmt)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("fmt,text,content,calls", WRITTEN)
def test_hand_written_outputs_read_whole_and_in_any_split(fmt, text, content, calls):
    assert _read(fmt, text) == (content, calls)
    whole = parse_tool_calls(text, fmt)[1]
    for seed in range(4):
        rng, parser, names, arguments, streamed, i = random.Random(seed), ToolCallParser(fmt), {}, {}, "", 0
        while i <= len(text):
            step = rng.randint(1, 9)
            piece, deltas = parser.feed(text[i:i + step], final=i + step >= len(text))
            streamed += piece
            for d in deltas:
                if "id" in d:
                    names[d["index"]] = d["function"]["name"]
                arguments[d["index"]] = arguments.get(d["index"], "") + d["function"]["arguments"]
            i += step
        assert (streamed.strip() or None) == content
        assert [(c.name, c.arguments) for c in whole] == [(names[k], arguments[k]) for k in sorted(names)]


@pytest.mark.parametrize("fmt,text", [
    ("hermes", '<tool_call>\n{"name": "add", "args": {}}\n</tool_call>'),
    ("llama3_json", '{"name": "add", "parameters": [1, 2]}'),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1}} and then some text'),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}} {"name": "now", "arguments": {}}]'),
    ("mistral", '[TOOL_CALLS]add'),
    ("mistral_v11", '[TOOL_CALLS]add[ARGS]"a"'),
    ("pythonic", "[add(1, 2)]"),
    ("pythonic", "[add(a=os.system('x'))]"),
    ("pythonic", "[add(a=1) add(b=2)]"),
    ("pythonic", "[add(**{'a': 1})]"),
])
def test_a_malformed_call_is_an_error_not_dropped(fmt, text):
    with pytest.raises(ToolCallError):
        parse_tool_calls(text, fmt)


@pytest.mark.parametrize("fmt,text", [
    ("hermes", 'Hi <tool_call>\n{"name": "add", "arguments": {"a": 1,'),
    ("llama3_json", '{"name": "add", "parameters": {"a"'),
    ("mistral", 'Hi [TOOL_CALLS][{"name": "ad'),
    ("mistral_v11", "[TOOL_CALLS]add[AR"),
    ("pythonic", '[add(a=1, b="x'),
])
def test_a_cut_off_call_is_content(fmt, text):
    assert parse_tool_calls(text, fmt) == (text, [])


def test_complete_calls_stand_when_only_the_lists_end_is_cut_off():
    content, calls = parse_tool_calls('[TOOL_CALLS][{"name": "now", "arguments": {}}', "mistral")
    assert content is None and [(c.name, c.arguments) for c in calls] == [("now", "{}")]


# ---- auto: the format from the chat template ---------------------------------------------------------

@pytest.mark.parametrize("template,fmt", [
    ("{{ '<tool_call>' }}{{ tools | tojson }}", "hermes"),
    ("{{ '<|python_tag|>' }}", "llama3_json"),
    ('Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}',
     "llama3_json"),
    ("[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS]", "mistral"),
    ("[AVAILABLE_TOOLS]{{ tools }}[TOOL_CALLS]{{ name }}[ARGS]{{ args }}", "mistral_v11"),
    ("[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]", "pythonic"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", "hermes"),
    ({"default": "plain", "tool_use": "[TOOL_CALLS]"}, "mistral"),
])
def test_auto_reads_the_format_from_the_chat_template(template, fmt):
    assert resolve("auto", template) == fmt
    assert resolve("pythonic", template) == "pythonic"  # a format named is the format used


# ---- what a format cannot write ------------------------------------------------------------------------

def test_pythonic_refuses_by_name_what_keywords_cannot_say(mgr):
    manager, _ = mgr
    loose = {"type": "object", "patternProperties": {"^x": {"type": "integer"}}, "properties": {"n": {}}}

    def compile_(*functions, fmt="pythonic"):
        return manager.compile(StructuredOutputs(tools=ToolCalls(functions, required=True, format=fmt)))

    with pytest.raises(GrammarError, match=r"tool f parameters: .*'patternProperties' at # .*pythonic"):
        compile_(Function("f", loose))
    assert compile_(Function("f", loose, strict=False)).unenforced == ("patternProperties at # in tool f",)
    assert compile_(Function("f", loose), fmt="hermes").unenforced == ()  # JSON formats hold it exactly
    with pytest.raises(GrammarError, match="'class' cannot be a Python keyword argument"):
        compile_(Function("f", {"type": "object", "properties": {"class": {"type": "integer"}}}, strict=False))
    with pytest.raises(GrammarError, match="not a Python name"):
        compile_(Function("my-tool"))
    with pytest.raises(GrammarError, match="tool pick parameters: .*'contains'"):  # the JSON rules still hold
        compile_(Function("pick", {"type": "object", "properties": {"xs": {"type": "array", "contains": {}}}}))
