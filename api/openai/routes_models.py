"""Service endpoints: GET /health (liveness), /ready (readiness), /version, /metrics, and the model list /v1/models (the base
model, then each adapter with the base as its parent; folders only for the admin)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

import loraplex
from loraplex.api.openai import openai_format as fmt
from loraplex.api.tenancy.auth import require_metrics, require_user, sees_paths
from loraplex.api.tenancy.callers import caller_of
from loraplex.api.errors import APIError, error_response
from loraplex.api.state import ServerState, state_of

router = APIRouter()


@router.get("/health")
async def health(state: ServerState = Depends(state_of)):
    problem = state.client.health().problem
    return Response(status_code=200) if problem is None else error_response(503, problem)


@router.get("/ready")
async def ready(state: ServerState = Depends(state_of)):
    """Readiness: the engine takes requests, the `--lora-modules` are loaded (before the app is
    built) and the grammar compile workers are started; 503 with what is missing until then."""
    health = state.client.health()
    problem = health.problem or health.warming
    if problem is not None:
        return error_response(503, problem)
    return {"ready": True}  # nothing more: /ready is open to every caller, like /health


@router.get("/version")
async def version():
    return {"version": loraplex.__version__}


@router.get("/metrics", dependencies=[Depends(require_metrics)])
async def metrics(state: ServerState = Depends(state_of)):
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def _cards(state: ServerState, request: Request) -> list[dict]:
    """The cards; folders (`root`) only for the admin."""
    config = state.config
    caller = caller_of(request)
    cards = fmt.model_list(config.served_model_name, config.model_path, state.client.max_model_len, state.created,
                           await state.adapters.infos(caller), sees_paths(request))["data"]
    return [card for card in cards if card["parent"] is not None or caller.may_use(None)]


@router.get("/v1/models", dependencies=[Depends(require_user)])
async def models(request: Request, state: ServerState = Depends(state_of)):
    return {"object": "list", "data": await _cards(state, request)}


@router.get("/v1/models/{model_id:path}", dependencies=[Depends(require_user)])
async def model(model_id: str, request: Request, state: ServerState = Depends(state_of)):
    for card in await _cards(state, request):
        if card["id"] == model_id:
            return card
    raise APIError(404, f"The model `{model_id}` does not exist.", "model")
