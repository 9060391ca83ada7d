"""What the web console needs beyond the OpenAI API: GET /v1/stats, POST /v1/validate_schema,
and the console itself, static files at /ui (every number on the page comes from the API)."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.staticfiles import StaticFiles

from loraplex.api.auth import require_user
from loraplex.api.callers import caller_of
from loraplex.api.errors import bad_input
from loraplex.api.protocol import ValidateSchemaRequest
from loraplex.api.state import ServerState, state_of

UI_DIR = Path(__file__).resolve().parent / "ui"
router = APIRouter(dependencies=[Depends(require_user)])


@router.get("/v1/stats")
async def stats(request: Request, state: ServerState = Depends(state_of)):
    """loraplex's own: queues, KV usage, token totals and recent latency percentiles, as JSON
    (the console's live view; /metrics has the same for Prometheus). A tenant sees only its own
    adapters among those running and waiting."""
    caller = caller_of(request)
    snapshot = state.metrics.snapshot()
    for key in ("running_adapters", "waiting_adapters"):
        snapshot[key] = [name for name in snapshot[key] if caller.may_use(name)]
    if caller.tenant is not None:  # a Ray ingress merging replicas' stats keeps to the same scope
        snapshot["adapter_scope"] = list(caller.tenant.adapters)
    return snapshot


@router.post("/v1/validate_schema")
async def validate_schema(body: ValidateSchemaRequest, state: ServerState = Depends(state_of)):
    """Compile a JSON Schema as a response_format would be, without generating: what would be
    refused is a 400 naming the keyword (the console checks schemas as they are typed)."""
    with bad_input():
        spec = body.structured()
    with bad_input("schema"):
        check = await state.client.validate_structured(spec)
    return {"valid": True, "backend": check.backend, "unenforced_keywords": list(check.unenforced)}


def mount_ui(app: FastAPI) -> None:
    app.mount("/ui", StaticFiles(directory=UI_DIR, html=True), name="ui")
