"""POST /v1/responses, and the stored responses: GET and DELETE /v1/responses/{id}, GET
/v1/responses/{id}/input_items.

A turn is a chat request (api/openai/responses_protocol.py): the stored conversation of
`previous_response_id`, then the instructions and this input. It runs through the same steps as
/v1/chat/completions (admission, adapter, template, sampling, grammar, billing); its outputs become the
Response object or the typed stream's events (api/openai/responses_format.py)."""

from __future__ import annotations

import contextlib
from typing import AsyncIterator

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from loraplex.api.errors import APIError, as_api_error, bad_input
from loraplex.api.openai import openai_format as fmt
from loraplex.api.openai import responses_format as rf
from loraplex.api.openai.generation import at_priority, end_lease, given, run
from loraplex.api.openai.response_store import StoredResponse
from loraplex.api.openai.responses_protocol import (FunctionCallItem, FunctionCallOutputItem, MessageItem,
                                                    ResponsesRequest, chat_messages)
from loraplex.api.openai.streaming import ClientGone, SSEResponse, until_disconnect
from loraplex.api.state import ServerState, state_of
from loraplex.api.tenancy import auth
from loraplex.api.tenancy.admission import admitted
from loraplex.api.tenancy.auth import require_user
from loraplex.api.tenancy.callers import caller_of

router = APIRouter(dependencies=[Depends(require_user)])
ECHOED = ("instructions", "max_output_tokens", "temperature", "top_p", "tool_choice", "tools", "text", "reasoning",
          "store", "metadata", "previous_response_id", "user", "parallel_tool_calls")


@router.post("/v1/responses")
async def create(body: ResponsesRequest, request: Request, state: ServerState = Depends(state_of)) -> Response:
    caller = caller_of(request)
    with bad_input():
        items = body.items()
        turn = chat_messages(items)
    history = _previous(state, request, body.previous_response_id)
    instructions = [{"role": "system", "content": body.instructions}] if body.instructions else []
    chat = _chat(body, instructions + (history.conversation if history else []) + turn)
    with admitted(state, caller, 1) as lease:
        adapter = await state.adapters.resolve_mix(chat.model, chat.adapter_weights(), caller)
        client = state.client
        with bad_input():
            messages, tools = chat.chat_messages(), chat.prompt_tools()
        with bad_input("input"):
            ids = await client.tokenize_chat(messages, True, chat.chat_template_kwargs, tools,
                                             adapter if isinstance(adapter, str) else None)
        with bad_input():
            params = chat.sampling_params(given(chat.max_completion_tokens, client.default_max_tokens(ids)), None,
                                          None, state.config.tool_call_parser, state.config.reasoning_parser)
        params = at_priority(request, [params])
        calls_tools = params[0].structured is not None and params[0].structured.kind == "tools"
        envelope = rf.Envelope(rf.new_id("resp"), body.model,
                               {**_echo(body), "store": body.store and bool(state.config.responses_store_max_count)})
        turn_record = _Turn(state, caller.owner, body, items, (history.conversation if history else []) + turn)
        updates = run(state, [ids], params, adapter, envelope.id, caller, lease, body.stream)
        return await _answer(request, updates, rf.ResponseEvents(envelope, calls_tools), turn_record, body.stream,
                             lease)


STORE_OFF = ("stored responses are off on this server (--responses-store-max-count 0; under --ray each replica would "
             "keep its own): send the whole conversation as input")


def _previous(state: ServerState, request: Request, response_id: str | None) -> StoredResponse | None:
    if response_id is None:
        return None
    if not state.config.responses_store_max_count:
        raise APIError(400, STORE_OFF, "previous_response_id")
    stored = state.responses.get(caller_of(request).owner, response_id)
    if stored is None:  # another owner's id reads as an unknown one
        raise APIError(404, f"no stored response with id {response_id!r}", "previous_response_id")
    return stored


def _chat(body: ResponsesRequest, messages: list[dict]):
    if not messages:
        raise APIError(400, "input holds no message (reasoning items alone are no turn)", "input")
    try:
        return body.chat_request(messages)
    except ValidationError as exc:
        errors = exc.errors()
        raise APIError(400, fmt.validation_message(errors), fmt.validation_param(errors)) from None
    except ValueError as exc:
        raise APIError(400, str(exc)) from None


def _echo(body: ResponsesRequest) -> dict:
    """The request's fields a Response object repeats (OpenAI's shape: a tool as sent, `text` with its format)."""
    echoed = {name: getattr(body, name) for name in ECHOED}
    echoed["tools"] = [t.model_dump(by_alias=True, exclude_none=True) for t in body.tools or []]
    choice = body.tool_choice
    echoed["tool_choice"] = choice.model_dump() if choice is not None and not isinstance(choice, str) else \
        choice or "auto"
    text_format = body.text.format if body.text is not None else None
    echoed["text"] = {"format": text_format.model_dump(by_alias=True, exclude_none=True) if text_format else
                      {"type": "text"}}
    echoed["reasoning"] = body.reasoning.model_dump() if body.reasoning else {"effort": None, "summary": None}
    echoed["parallel_tool_calls"] = body.parallel_tool_calls is not False
    echoed["metadata"] = body.metadata or {}
    return {**echoed, "truncation": "disabled", "top_logprobs": 0, "background": False}


class _Turn:
    """What a stored response keeps of its turn: the input as items with ids, and the conversation it ends."""

    def __init__(self, state: ServerState, owner: str, body: ResponsesRequest, items: list, context: list[dict]):
        self.state, self.owner, self.store = state, owner, body.store
        self.items, self.context = items, context

    def keep(self, response: dict) -> None:
        if self.store and response["status"] in ("completed", "incomplete"):
            self.state.responses.put(self.owner, response, _input_items(self.items),
                                     self.context + _as_messages(response["output"]))


def _input_items(items: list) -> list[dict]:
    out = []
    for item in items:
        if isinstance(item, MessageItem):
            kind = "output_text" if item.role == "assistant" else "input_text"
            out.append({"id": item.id or rf.new_id("msg"), "type": "message", "role": item.role, "status": "completed",
                        "content": [{"type": kind, "text": item.text()}]})
        elif isinstance(item, FunctionCallItem):
            out.append({"id": item.id or rf.new_id("fc"), "type": "function_call", "call_id": item.call_id,
                        "name": item.name, "arguments": item.arguments, "status": "completed"})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"id": item.id or rf.new_id("fco"), "type": "function_call_output", "call_id": item.call_id,
                        "output": item.text(), "status": "completed"})
        else:  # a replayed reasoning item
            out.append({**item.model_dump(exclude_none=True), "id": item.id or rf.new_id("rs")})
    return out


def _as_messages(output: list[dict]) -> list[dict]:
    """A response's output as the next turn's chat messages: its text, its calls (its reasoning left out)."""
    text = rf.output_text(output)
    calls = [{"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in output if it["type"] == "function_call" and it["status"] == "completed"]
    message: dict = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return [message]


async def _answer(request: Request, updates, events: rf.ResponseEvents, turn: _Turn, stream: bool,
                  lease) -> Response:
    """The Response object, or the event stream once the first output is in (errors before it are HTTP errors)."""
    try:
        if not stream:
            await until_disconnect(request, _drain(updates, events))
            response = events.envelope.response(events.out.status, rf.output_items(events.out, events.tools),
                                                events.out)
            turn.keep(response)
            return JSONResponse(response, headers=fmt.unenforced_header(events.out.unenforced))
        first = await until_disconnect(request, anext(updates))
    except ClientGone:
        await updates.aclose()
        end_lease(lease, 0)  # a no-op unless the client left before the generation started
        return Response(status_code=499)
    except StopAsyncIteration:
        first = None
    except BaseException:
        await updates.aclose()
        end_lease(lease, 0)
        raise
    shown = lambda text: auth.shown(request, text)  # noqa: E731
    headers = fmt.unenforced_header(first[1].unenforced if first else ())
    return SSEResponse(_events(updates, first, events, turn, shown), headers)


async def _drain(updates, events: rf.ResponseEvents) -> None:
    async with contextlib.aclosing(updates) as it:
        async for _, delta in it:
            events.out.feed(delta)


async def _events(updates, first, events: rf.ResponseEvents, turn: _Turn, shown) -> AsyncIterator[str]:
    try:
        for event in events.start():
            yield _sse(event)
        if first is not None:
            for event in events.feed(first[1]):
                yield _sse(event)
        async for _, delta in updates:
            for event in events.feed(delta):
                yield _sse(event)
        finished = events.finish()
        turn.keep(finished[-1]["response"])
        for event in finished:
            yield _sse(event)
    except Exception as exc:  # mid-stream: the status line is gone, so the error is an event, and the response failed
        api = as_api_error(exc)
        yield _sse(events.event("error", code=str(api.status), message=shown(api.message), param=api.param))
        failed = events.envelope.response("failed", events.items, events.out)
        failed["error"] = {"code": "server_error" if api.status >= 500 else "invalid_prompt",
                           "message": shown(api.message)}
        yield _sse(events.event("response.failed", response=failed))
    finally:
        await updates.aclose()


def _sse(event: dict) -> str:
    return f"event: {event['type']}\n{fmt.sse(event)}"


@router.get("/v1/responses/{response_id}")
async def retrieve(response_id: str, request: Request, state: ServerState = Depends(state_of)) -> dict:
    return _stored(state, request, response_id).response


@router.delete("/v1/responses/{response_id}")
async def delete(response_id: str, request: Request, state: ServerState = Depends(state_of)) -> dict:
    _stored(state, request, response_id)
    if not state.responses.delete(caller_of(request).owner, response_id):
        raise APIError(404, f"no stored response with id {response_id!r}")
    return {"id": response_id, "object": "response", "deleted": True}


@router.get("/v1/responses/{response_id}/input_items")
async def input_items(response_id: str, request: Request, state: ServerState = Depends(state_of),
                      limit: int = Query(20, ge=1, le=100), order: str = Query("desc", pattern="^(asc|desc)$"),
                      after: str | None = None) -> dict:
    items = _stored(state, request, response_id).input_items
    items = items[::-1] if order == "desc" else list(items)
    if after is not None:
        at = next((i for i, item in enumerate(items) if item["id"] == after), None)
        if at is None:
            raise APIError(400, f"after: {after!r} is not an input item of this response", "after")
        items = items[at + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


def _stored(state: ServerState, request: Request, response_id: str) -> StoredResponse:
    if not state.config.responses_store_max_count:
        raise APIError(404, f"no stored response with id {response_id!r} ({STORE_OFF})")
    stored = state.responses.get(caller_of(request).owner, response_id)
    if stored is None:
        raise APIError(404, f"no stored response with id {response_id!r}")
    return stored
