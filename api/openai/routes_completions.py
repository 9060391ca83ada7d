"""POST /v1/completions."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from loraplex.api.openai import openai_format as fmt
from loraplex.api.tenancy.admission import admitted
from loraplex.api.tenancy.auth import require_user
from loraplex.api.tenancy.callers import caller_of
from loraplex.api.errors import bad_input
from loraplex.api.openai.generation import given, respond
from loraplex.api.openai.protocol import CompletionRequest
from loraplex.api.state import ServerState, state_of

router = APIRouter(dependencies=[Depends(require_user)])


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, state: ServerState = Depends(state_of)):
    caller = caller_of(request)
    with bad_input():
        prompts = body.prompts()
    with admitted(state, caller, len(prompts) * body.n) as lease:  # each prompt is n sequences
        adapter = await state.adapters.resolve_mix(body.model, body.adapter_weights(), caller)
        client = state.client
        name = adapter if isinstance(adapter, str) else None  # an adapter's own tokenizer, where it brings one
        ids = [await _token_ids(client, p, name) for p in prompts]
        with bad_input():
            params = [body.sampling_params(given(body.max_tokens, client.default_max_tokens(i)), body.logprobs,
                                           body.num_prompt_logprobs()) for i in ids]
        echo = [await _text(client, p, name) for p in prompts] if body.echo else None
        view = fmt.CompletionView(body.model, body.n, echo, body.logprobs, body.prompt_logprobs is not None)
        return await respond(state, request, body, ids, params, adapter, view, lease)


async def _token_ids(client, prompt: str | dict, adapter: str | None) -> list[int]:
    if not isinstance(prompt, str):
        return prompt["prompt_token_ids"]
    with bad_input("prompt"):
        return await client.tokenize(prompt, adapter=adapter)


async def _text(client, prompt: str | dict, adapter: str | None) -> str:
    """The prompt as text, for echo."""
    if isinstance(prompt, str):
        return prompt
    with bad_input("prompt"):
        return await client.detokenize(prompt["prompt_token_ids"], "prompt", adapter)
