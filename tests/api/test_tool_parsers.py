"""Each family's tool-call format through a real server (`--tool-call-parser auto`: the format
comes from the chat template's markers). The tiny model's tokenizer holds the markers as its own
tokens, as real ones do (`<tool_call>` added like Qwen's, `[TOOL_CALLS]` and `<|python_tag|>`
special, so skipped unless the server keeps them); random weights under the grammar: every call
must parse and validate against its function's schema, whole and streamed alike, for
`required`, a named function and `auto`."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from tokenizers import AddedToken
from transformers import AutoTokenizer

from conftest import assert_all_blocks_free, make_tiny_model
import live_server
from live_server import USER_KEY, assert_error, http, start_server, wait_idle

MSG = [{"role": "user", "content": "Hello world, hello adapters"}]
UNIT = {"type": "object", "additionalProperties": False, "required": ["unit"],
        "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "exact": {"type": "boolean"}}}
COUNT = {"type": "object", "additionalProperties": False, "required": ["n"],
         "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}}
TOOLS = [{"type": "function", "function": {"name": "set_unit", "parameters": UNIT}},
         {"type": "function", "function": {"name": "count", "parameters": COUNT}}]
SCHEMAS = {"set_unit": UNIT, "count": COUNT}
ADDED = [AddedToken("<tool_call>", special=False, normalized=False),
         AddedToken("</tool_call>", special=False, normalized=False)]
SPECIAL = [AddedToken(t, special=True, normalized=False) for t in ("[TOOL_CALLS]", "[ARGS]", "<|python_tag|>")]
BODY = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def template(markers: str) -> str:
    """A terse template that renders the tools' names and, as a family's does, its markers."""
    return "{% if tools %}" + markers + "{% for t in tools %} {{ t.function.name }}{% endfor %}{% endif %}" + BODY


TEMPLATES = {  # format -> (template, the text its calls open with, which `auto` is nudged to)
    "hermes": (template("<tools></tools> reply in <tool_call></tool_call>"), "<tool_call>"),
    "llama3_json": (template('reply {"name": function name, "parameters": dictionary of argument name}'), "{"),
    "mistral": (template("[AVAILABLE_TOOLS][/AVAILABLE_TOOLS] [TOOL_CALLS]"), "[TOOL_CALLS]"),
    "mistral_v11": (template("[AVAILABLE_TOOLS] [TOOL_CALLS]name[ARGS]{}"), "[TOOL_CALLS]"),
    "pythonic": (template("reply [func_name1(params_name1=params_value1), func_name2(params)]"), "["),
}


@pytest.fixture(scope="module")
def marked(tmp_path_factory):
    """A server over a tiny model whose tokenizer holds the formats' markers as tokens."""
    from loraplex.api.server import ServerConfig

    folder = make_tiny_model(tmp_path_factory.mktemp("tiny-markers"))
    tok = AutoTokenizer.from_pretrained(folder)
    tok.add_tokens(ADDED)
    tok.add_tokens(SPECIAL, special_tokens=True)
    tok.save_pretrained(folder)
    config = ServerConfig(served_model_name="tiny", model_path=str(folder), api_key=USER_KEY)
    server = start_server(folder, config, num_kv_blocks=64, max_num_seqs=8)
    yield server
    server.stop()


@pytest.fixture
def client(marked):
    import openai

    return openai.OpenAI(base_url=marked.url + "/v1", api_key=USER_KEY, max_retries=0, timeout=60)


def use(marked, monkeypatch, fmt: str) -> dict[str, float]:
    """The chat template of `fmt`; the logit bias that makes `auto` open a call."""
    chat_template, opener = TEMPLATES[fmt]
    monkeypatch.setattr(marked.engine.tokenizer, "chat_template", chat_template)
    ids = marked.engine.tokenizer.encode(opener, add_special_tokens=False)
    assert len(ids) == 1, opener
    return {str(ids[0]): 100}


def check_calls(calls, name: str | None = None) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        assert name is None or call.function.name == name
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed(chunks) -> tuple[str, list[tuple[str, str]], list[str]]:
    """Content, each call's (name, arguments) in index order, and the finish reasons."""
    content, calls, finishes = live_server.streamed(chunks)
    return content, [tuple(calls[i]) for i in sorted(calls)], finishes


CHOICES = {"required": "required", "named": {"type": "function", "function": {"name": "set_unit"}}, "auto": "auto"}


@pytest.mark.parametrize("fmt", list(TEMPLATES))
@pytest.mark.parametrize("choice", list(CHOICES))
def test_each_format_round_trips_calls_whole_and_streamed(client, marked, monkeypatch, fmt, choice):
    bias = use(marked, monkeypatch, fmt)
    args = dict(model="tiny", messages=MSG, tools=TOOLS, tool_choice=CHOICES[choice], max_tokens=120,
                temperature=0, parallel_tool_calls=False, logit_bias=bias if choice == "auto" else None)
    reply = client.chat.completions.create(**args)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls", message
    check_calls(message.tool_calls, "set_unit" if choice == "named" else None)
    assert len(message.tool_calls) == 1
    short = re.fullmatch("[A-Za-z0-9]{9}", message.tool_calls[0].id) is not None  # Mistral's templates take no other
    assert short if fmt.startswith("mistral") else message.tool_calls[0].id.startswith("call_")
    content, calls, finishes = streamed(client.chat.completions.create(stream=True, **args))
    assert finishes == ["tool_calls"] and content == (message.content or "")
    assert calls == [(c.function.name, c.function.arguments) for c in message.tool_calls]
    wait_idle(marked.engine)
    assert_all_blocks_free(marked.engine)


@pytest.mark.parametrize("fmt", ["llama3_json", "mistral", "pythonic"])
def test_several_calls_in_one_reply(client, marked, monkeypatch, fmt):
    use(marked, monkeypatch, fmt)
    replies = [client.chat.completions.create(model="tiny", messages=MSG, tools=TOOLS, tool_choice="required",
                                              max_tokens=200, temperature=1.0, seed=seed) for seed in range(4)]
    for reply in replies:
        if reply.choices[0].finish_reason == "tool_calls":
            check_calls(reply.choices[0].message.tool_calls)
    assert any(len(r.choices[0].message.tool_calls or []) > 1 for r in replies)  # random weights: it goes on


def test_the_format_is_the_chat_templates_and_tools_reach_it(marked, monkeypatch):
    use(marked, monkeypatch, "mistral")
    status, out = http(marked, "/tokenize", {"model": "tiny", "messages": MSG, "tools": TOOLS})
    text = http(marked, "/detokenize", {"model": "tiny", "tokens": out["tokens"]})[1]["prompt"]
    assert text.startswith("[AVAILABLE_TOOLS][/AVAILABLE_TOOLS] [TOOL_CALLS] set_unit count")
    status, out = http(marked, "/v1/chat/completions", {"model": "tiny", "messages": MSG, "tools": TOOLS,
                                                        "tool_choice": "required", "max_tokens": 60,
                                                        "temperature": 0, "parallel_tool_calls": False})
    assert status == 200 and out["choices"][0]["message"]["tool_calls"], out


def test_refusals_name_what_the_format_cannot_write(marked, monkeypatch):
    use(marked, monkeypatch, "pythonic")
    body = {"model": "tiny", "messages": MSG, "max_tokens": 4, "tool_choice": "required"}
    loose = {"type": "object", "minProperties": 1, "properties": {"n": {"type": "integer"}}}
    cases = [([{"type": "function", "function": {"name": "f", "parameters": loose}}],
              "tool f parameters: json schema keyword 'minproperties' at # is not supported by the pythonic"),
             ([{"type": "function", "function": {"name": "f", "parameters": {
                 "type": "object", "properties": {"class": {"type": "integer"}}}}}], "'class'"),
             ([{"type": "function", "function": {"name": "my-tool"}}], "not a python name")]
    for tools, fragment in cases:
        assert_error(http(marked, "/v1/chat/completions", {**body, "tools": tools}), 400, fragment)
    lenient = [{"type": "function", "function": {"name": "f", "parameters": loose, "strict": False}}]
    status, out = http(marked, "/v1/chat/completions", {**body, "tools": lenient, "max_tokens": 96})
    assert status == 200 and out["unenforced_keywords"] == ["minProperties at # in tool f"], out
    assert_error(http(marked, "/v1/chat/completions", {**body, "tools": TOOLS, "max_reasoning_tokens": 4}), 400,
                 "max_reasoning_tokens needs a reasoning parser")
