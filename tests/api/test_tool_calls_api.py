"""Tool calling through the official client on the tiny model (random weights: the grammar and
the OpenAI shapes, not the model's judgement): calls whole and streamed, per adapter and in one
batch, tool turns templated, and every misuse a 400 that names it."""

from __future__ import annotations

import concurrent.futures as cf
import json

import jsonschema
import pytest

from conftest import assert_all_blocks_free
from live_server import assert_error, client, http, live, streamed, wait_idle  # noqa: F401

MSG = [{"role": "user", "content": "Hello world, hello adapters"}]
UNIT = {"type": "object", "additionalProperties": False, "required": ["unit"],
        "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}}
COUNT = {"type": "object", "additionalProperties": False, "required": ["n"],
         "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}}
TOOLS = [{"type": "function", "function": {"name": "set_unit", "description": "Pick a unit", "parameters": UNIT}},
         {"type": "function", "function": {"name": "count", "parameters": COUNT}}]
SCHEMAS = {"set_unit": UNIT, "count": COUNT}
# a template that renders tools itself, tersely (the tiny model's context is 512 tokens; the
# fallback system prompt for templates without tools is tested on the default model)
TOOL_TEMPLATE = ("{% for t in tools or [] %}{{ t.function.name }} {% endfor %}{% for m in messages %}<|im_start|>"
                 "{{ m.role }}\n{{ m.content or '' }}{% for c in m.tool_calls or [] %}{{ c.function.name }}"
                 "{{ c.function.arguments | tojson }}{% endfor %}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(autouse=True)
def terse_tool_template(live, monkeypatch):
    monkeypatch.setattr(live.engine.tokenizer, "chat_template", TOOL_TEMPLATE)


def check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("model", ["tiny", "tiny:a0"])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "count"}}],
                         ids=["required", "named"])
def test_required_and_named_calls_are_valid_streamed_or_not(client, live, model, choice):
    args = dict(model=model, messages=MSG, tools=TOOLS, tool_choice=choice, max_tokens=150, temperature=0,
                parallel_tool_calls=False)
    reply = client.chat.completions.create(**args)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and message.content is None
    check_calls(message.tool_calls)
    assert len(message.tool_calls) == 1
    if isinstance(choice, dict):
        assert message.tool_calls[0].function.name == "count"
    content, calls, finishes = streamed(client.chat.completions.create(stream=True, **args))
    assert content == "" and finishes == ["tool_calls"]
    assert [tuple(calls[i]) for i in sorted(calls)] == [(c.function.name, c.function.arguments)
                                                        for c in message.tool_calls]
    wait_idle(live.engine)
    assert_all_blocks_free(live.engine)


def test_parallel_calls_and_a_mixed_batch_of_adapters(client, live):
    def ask(model: str, seed: int):
        return client.chat.completions.create(model=model, messages=MSG, tools=TOOLS, tool_choice="required",
                                              max_tokens=300, temperature=1.0, seed=seed)

    with cf.ThreadPoolExecutor(6) as pool:  # base and adapters in the same batches
        replies = list(pool.map(ask, ["tiny", "a0", "a1"] * 4, range(12)))
    for reply in replies:
        if reply.choices[0].finish_reason == "tool_calls":
            check_calls(reply.choices[0].message.tool_calls)
    assert sum(r.choices[0].finish_reason == "tool_calls" for r in replies) >= 8
    assert any(len(r.choices[0].message.tool_calls or []) > 1 for r in replies)  # random weights: it goes on


def test_auto_is_text_or_a_valid_call_and_none_is_text(client):
    for seed in range(3):
        reply = client.chat.completions.create(model="tiny", messages=MSG, tools=TOOLS, max_tokens=12, seed=seed)
        message = reply.choices[0].message
        assert message.tool_calls is None or reply.choices[0].finish_reason == "tool_calls"
        if message.tool_calls:
            check_calls(message.tool_calls)
    reply = client.chat.completions.create(model="tiny", messages=MSG, tools=TOOLS, tool_choice="none",
                                           max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason == "length"


def test_a_tool_round_trip_reaches_the_prompt(client, live):
    call = {"id": "call_1", "type": "function", "function": {"name": "count", "arguments": '{"n": 3}'}}
    turn = [*MSG, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "three"}]
    plain = client.chat.completions.create(model="tiny", messages=MSG, tools=TOOLS, max_tokens=1)
    after = client.chat.completions.create(model="tiny", messages=turn, tools=TOOLS, max_tokens=4)
    assert after.usage.prompt_tokens > plain.usage.prompt_tokens + 10  # the call and its result are in
    rendered = http(live, "/tokenize", {"model": "tiny", "messages": turn})[1]["tokens"]
    text = http(live, "/detokenize", {"model": "tiny", "tokens": rendered})[1]["prompt"]
    assert 'count{"n": 3}' in text and "three" in text
    with_tools = http(live, "/tokenize", {"model": "tiny", "messages": turn, "tools": TOOLS})[1]["tokens"]
    assert http(live, "/detokenize", {"model": "tiny", "tokens": with_tools})[1]["prompt"].startswith("set_unit count")
    assert after.choices[0].message.content is not None or after.choices[0].message.tool_calls


def test_tool_misuse_is_a_400_naming_it(live):
    body = {"model": "tiny", "messages": MSG, "max_tokens": 4}
    cases = [
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "cannot be combined with tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "letters, digits"),
        ({"tools": TOOLS + TOOLS[:1]}, "unique"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
         "must describe a JSON object"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"xs": {"type": "array", "contains": {"type": "integer"}}}}}}]},
         "tool f parameters: json schema keyword 'contains'"),
        ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "sometimes", "tools": TOOLS}, "tool_choice"),
    ]
    for extra, fragment in cases:
        assert_error(http(live, "/v1/chat/completions", {**body, **extra}), 400, fragment)
    loose = {"type": "function", "function": {"name": "f", "strict": False, "parameters": {
        "type": "object", "properties": {"xs": {"type": "array", "contains": {"type": "integer"}}}}}}
    status, out = http(live, "/v1/chat/completions", {**body, "tools": [loose], "tool_choice": "required",
                                                      "max_tokens": 96})  # room for the call's shortest form
    assert status == 200 and out["unenforced_keywords"] == ["contains at #/properties/xs in tool f"], out
