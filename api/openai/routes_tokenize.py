"""POST /tokenize (a prompt, or messages through the chat template) and POST /detokenize."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from loraplex.api.tenancy.admission import one_call
from loraplex.api.tenancy.auth import require_user
from loraplex.api.tenancy.callers import caller_of
from loraplex.api.errors import APIError, bad_input
from loraplex.api.openai.protocol import DetokenizeRequest, TokenizeRequest, chat_dicts
from loraplex.api.state import ServerState, state_of

router = APIRouter(dependencies=[Depends(require_user)])


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request, state: ServerState = Depends(state_of)):
    with one_call(state, caller_of(request)):
        return await _tokenize(body, request, state)


async def _tokenize(body: TokenizeRequest, request: Request, state: ServerState) -> Response:
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt or messages")
    if body.model is not None:  # a model the caller may not use is the same 404 as a missing one
        state.adapters.check_visible(body.model, caller_of(request))
    client = state.client
    if body.messages is not None:
        with bad_input():
            messages = chat_dicts(body.messages)
        with bad_input("messages"):
            ids = await client.tokenize_chat(messages, body.add_generation_prompt, body.chat_template_kwargs,
                                             body.template_tools())
    else:
        with bad_input("prompt"):
            ids = await client.tokenize(body.prompt, body.add_special_tokens)
    text = await asyncio.to_thread(_tokens_json, len(ids), client.max_model_len, ids)
    return Response(text, media_type="application/json")


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request, state: ServerState = Depends(state_of)):
    with one_call(state, caller_of(request)), bad_input("tokens"):
        return {"prompt": await state.client.detokenize(body.tokens, "tokens")}


def _tokens_json(count: int, max_model_len: int, ids: list[int]) -> str:
    """/tokenize's body, encoded in a worker thread and in chunks: a megabyte prompt's ids are
    megabytes of JSON, and one C call encoding them all would hold the GIL (and so the event
    loop: /health, every stream) for its whole run."""
    chunks = [",".join(map(str, ids[i:i + 65536])) for i in range(0, len(ids), 65536)]
    return f'{{"count": {count}, "max_model_len": {max_model_len}, "tokens": [{",".join(chunks)}]}}'
