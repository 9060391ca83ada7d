"""POST /v1/chat/completions."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from loraplex.api.openai import openai_format as fmt
from loraplex.api.tenancy.admission import admitted
from loraplex.api.tenancy.auth import require_user
from loraplex.api.tenancy.callers import caller_of
from loraplex.api.errors import bad_input
from loraplex.api.openai.generation import given, respond
from loraplex.api.openai.protocol import ChatCompletionRequest
from loraplex.api.state import ServerState, state_of

router = APIRouter(dependencies=[Depends(require_user)])


@router.post("/v1/chat/completions")
async def chat(body: ChatCompletionRequest, request: Request, state: ServerState = Depends(state_of)):
    with admitted(state, caller_of(request), body.n) as lease:
        adapter = await state.adapters.resolve_mix(body.model, body.adapter_weights(), caller_of(request))
        client = state.client
        with bad_input():
            messages, tools = body.chat_messages(), body.prompt_tools()
        with bad_input("messages"):
            ids = await client.tokenize_chat(messages, body.add_generation_prompt, body.chat_template_kwargs, tools,
                                             adapter if isinstance(adapter, str) else None)
        max_tokens = given(body.max_completion_tokens, given(body.max_tokens, client.default_max_tokens(ids)))
        with bad_input():
            params = body.sampling_params(max_tokens, body.num_logprobs(), body.prompt_logprobs,
                                          state.config.tool_call_parser, state.config.reasoning_parser)
        calls_tools = params.structured is not None and params.structured.kind == "tools"
        view = fmt.ChatView(body.model, body.n, body.top_logprobs or 0, calls_tools, params.reasoning is not None)
        return await respond(state, request, body, [ids], [params], adapter, view, lease)
