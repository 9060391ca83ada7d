"""POST /v1/responses and the stored responses through a real server and the official client: plain, adapter,
mix, `text.format` json_schema strict, streamed (the typed stream's events, deltas adding up to the final
text), function tools answered with `function_call_output` through `previous_response_id` (the history
from the prefix cache), retrieve / input_items / delete, owners, and the refusals."""

from __future__ import annotations

import json

import jsonschema
import pytest
from openai.types.responses import response_create_params

from live_server import ADMIN_KEY, SCHEMA, assert_error, client, http, live  # noqa: F401
from loraplex.api.openai.response_store import ResponseStore
from loraplex.api.openai.responses_protocol import IGNORED, REFUSED, ResponsesRequest

COUNT = {"type": "object", "additionalProperties": False, "required": ["n"],
         "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}}
TOOLS = [{"type": "function", "name": "count", "parameters": COUNT}]


def test_every_field_of_the_clients_request_is_implemented_refused_or_ignored():
    fields = set(response_create_params.ResponseCreateParamsBase.__annotations__) | {"stream"}
    unaccounted = sorted(f for f in fields if f not in ResponsesRequest.model_fields and f not in REFUSED
                         and f not in IGNORED)
    assert not unaccounted


def test_a_response_is_the_chat_completions_answer_and_is_stored(client, live):
    chat = client.chat.completions.create(model="tiny:a0", messages=[{"role": "system", "content": "Be brief."},
                                                                     {"role": "user", "content": "Hello there"}],
                                          max_tokens=6, temperature=0)
    response = client.responses.create(model="tiny:a0", instructions="Be brief.", input="Hello there",
                                       max_output_tokens=6, temperature=0, metadata={"k": "v"})
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
    assert response.metadata == {"k": "v"} and response.instructions == "Be brief."
    assert client.responses.retrieve(response.id).output_text == response.output_text
    items = client.responses.input_items.list(response.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "Hello there")]
    assert_error(http(live, f"/v1/responses/{response.id}", key=ADMIN_KEY), 404)  # another owner: unknown
    assert http(live, f"/v1/responses/{response.id}", method="DELETE")[1]["deleted"] is True
    assert_error(http(live, f"/v1/responses/{response.id}"), 404)


def test_a_mix_and_store_false(client, live):
    response = client.responses.create(model="tiny", input="Hello", max_output_tokens=3, temperature=0, store=False,
                                       extra_body={"adapters": [{"name": "a0", "weight": 0.5},
                                                                {"name": "a1", "weight": 0.5}]})
    assert response.usage.output_tokens == 3
    assert_error(http(live, f"/v1/responses/{response.id}"), 404)


def test_json_schema_strict_holds_whole_and_streamed(client):
    text = {"format": {"type": "json_schema", "name": "thing", "schema": SCHEMA, "strict": True}}
    whole = client.responses.create(model="tiny", input="A thing as JSON", text=text, max_output_tokens=60,
                                    temperature=0)
    assert whole.status == "completed", whole.output_text
    jsonschema.validate(json.loads(whole.output_text), SCHEMA)
    events = list(client.responses.create(model="tiny", input="A thing as JSON", text=text, max_output_tokens=60,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == whole.output_text
    jsonschema.validate(json.loads(deltas), SCHEMA)
    with client.responses.stream(model="tiny", input="A thing as JSON", text=text, max_output_tokens=60,
                                 temperature=0) as stream:
        assert stream.get_final_response().output_text == whole.output_text


def test_function_calls_answered_through_previous_response_id(client):
    first = client.responses.create(model="tiny", input="Count something", tools=TOOLS, tool_choice="required",
                                    max_output_tokens=100, temperature=0, parallel_tool_calls=False)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "count", first.output
    jsonschema.validate(json.loads(calls[0].arguments), COUNT)
    second = client.responses.create(model="tiny", previous_response_id=first.id, tools=TOOLS,
                                     input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                             "output": "3"}], max_output_tokens=4, temperature=0)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0  # the history's blocks came from the prefix cache
    items = client.responses.input_items.list(second.id).data
    assert [(i.type, i.call_id, i.output) for i in items] == [("function_call_output", calls[0].call_id, "3")]
    replayed = client.responses.create(model="tiny", tools=TOOLS, max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": "Count something"}, *[c.model_dump(exclude_none=True) for c in calls],
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "3"}])
    assert replayed.usage.input_tokens == second.usage.input_tokens and replayed.output_text == second.output_text


def test_streamed_function_calls_add_up(client):
    events = list(client.responses.create(model="tiny", input="Count", tools=TOOLS, tool_choice="required",
                                          max_output_tokens=100, temperature=0, stream=True,
                                          parallel_tool_calls=False))
    final = events[-1].response
    calls = [item for item in final.output if item.type == "function_call"]
    assert calls and events[-1].type == "response.completed"
    for call in calls:
        deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta"
                         and e.item_id == call.id)
        assert deltas == call.arguments and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), COUNT)


@pytest.mark.parametrize("body,status,param", [
    ({"previous_response_id": "resp_nope"}, 404, "previous_response_id"),
    ({"input": [{"type": "image_generation_call", "id": "x"}]}, 400, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input.content.type"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, 400, None),
    ({"background": True}, 400, "background"),
    ({"tools": [{"type": "web_search"}]}, 400, "tools"),
    ({"truncation": "auto"}, 400, "truncation"),
    ({"priority": 5}, 400, "--scheduling-policy priority"),  # this server schedules fcfs
    ({"priority": 2**31}, 400, "priority"),  # the batch priority is the server's own
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, 400, None),
])
def test_bad_input_is_a_clear_4xx(live, body, status, param):
    code, error = http(live, "/v1/responses", {"model": "tiny", "input": "Hi", "max_output_tokens": 2, **body})
    assert_error((code, error), status)
    if param is not None:
        assert param in (error["error"]["param"] or "") + error["error"]["message"], error


def test_the_store_is_bounded_by_count_and_bytes_and_keeps_owners_apart():
    store = ResponseStore(max_count=2, max_bytes=2000)
    for i in range(3):
        assert store.put("me", {"id": f"r{i}"}, [], [])
    assert store.get("me", "r0") is None and store.get("me", "r2") is not None and len(store) == 2
    assert store.get("someone", "r2") is None and not store.delete("someone", "r2")
    assert not store.put("me", {"id": "big", "pad": "x" * 3000}, [], [])
    by_bytes = ResponseStore(max_count=10, max_bytes=2000)
    for i in range(3):
        by_bytes.put("me", {"id": f"r{i}", "pad": "x" * 900}, [], [])
    assert by_bytes.get("me", "r0") is None and len(by_bytes) == 2 and by_bytes.bytes <= 2000


def test_serving_md_lists_what_is_refused_and_ignored():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    section = doc[doc.index("### The Responses API"):]
    for name in [*REFUSED, *IGNORED]:
        assert f"`{name}`" in section, name


def test_replayed_reasoning_items_are_listed_with_ids(client):
    response = client.responses.create(model="tiny", max_output_tokens=2, temperature=0, input=[
        {"type": "reasoning", "summary": []}, {"role": "user", "content": "Hi"}])
    items = client.responses.input_items.list(response.id, order="asc").data
    assert [i.type for i in items] == ["reasoning", "message"] and all(i.id for i in items)
    assert [i.type for i in client.responses.input_items.list(response.id, order="asc", after=items[0].id).data] == \
        ["message"]


def test_with_the_store_off_nothing_is_kept_and_a_stored_id_is_refused(client, live, monkeypatch):
    import dataclasses

    state = live.uvicorn_server.config.app.state.loraplex
    monkeypatch.setattr(state, "config", dataclasses.replace(state.config, responses_store_max_count=0))
    response = client.responses.create(model="tiny", input="Hi", max_output_tokens=2, temperature=0)
    assert response.store is False
    assert_error(http(live, f"/v1/responses/{response.id}"), 404, "stored responses are off")
    assert_error(http(live, "/v1/responses", {"model": "tiny", "input": "Hi", "previous_response_id": response.id}),
                 400, "stored responses are off")
