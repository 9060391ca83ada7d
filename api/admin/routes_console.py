"""What the web console needs beyond the OpenAI API: GET /v1/stats, POST /v1/validate_schema,
and the console itself, static files at /ui (every number on the page comes from the API)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.staticfiles import StaticFiles

from loraplex.api.tenancy.admission import one_call
from loraplex.api.tenancy.auth import require_user
from loraplex.api.tenancy.callers import caller_of
from loraplex.api.errors import bad_input
from loraplex.api.openai.protocol import ValidateSchemaRequest
from loraplex.api.state import ServerState, state_of
from loraplex.api.tenancy.tenants import Tenant, Tenants

UI_DIR = Path(__file__).resolve().parents[1] / "ui"
router = APIRouter(dependencies=[Depends(require_user)])


@router.get("/v1/stats")
async def stats(request: Request, state: ServerState = Depends(state_of)):
    """loraplex's own: queues, KV usage, token totals, recent latency percentiles and speculative decoding
    counters, as JSON (the console's live view; /metrics has the same for Prometheus). A tenant reads numbers
    of its own requests only, never the engine's (docs/tenants.md, "What a tenant reads")."""
    caller = caller_of(request)
    if caller.tenant is None:
        return state.metrics.server_snapshot()
    owns = _alone_on(caller.tenant, state.tenants.current)
    # named for a Ray ingress, which merges this tenant's numbers from every replica (api/cluster/ray_serve.py)
    return {**state.metrics.tenant_snapshot(caller.tenant.name), "tenant": caller.tenant.name,
            "adapter_scope": list(caller.tenant.adapters), "spec_decode": state.metrics.tenant_spec_decode(owns)}


def _alone_on(tenant: Tenant, tenants: Tenants | None) -> Callable[[str], bool]:
    """The adapters only `tenant` may use: the engine counts speculation per adapter, not per caller, so an
    adapter another tenant's patterns also match would show that tenant's traffic."""
    others = [t for t in (tenants.by_name.values() if tenants is not None else ()) if t.name != tenant.name]
    return lambda name: tenant.may_use(name) and not any(t.may_use(name) for t in others)


@router.post("/v1/validate_schema")
async def validate_schema(body: ValidateSchemaRequest, request: Request, state: ServerState = Depends(state_of)):
    """Compile a JSON Schema as a response_format would be, without generating: what would be
    refused is a 400 naming the keyword (the console checks schemas as they are typed). A compile
    is work: a tenant's call counts against its limits."""
    with bad_input():
        spec = body.structured()
    with one_call(state, caller_of(request)), bad_input("schema"):
        check = await state.client.validate_structured(spec, caller_of(request).share)
    return {"valid": True, "backend": check.backend, "unenforced_keywords": list(check.unenforced)}


def mount_ui(app: FastAPI) -> None:
    app.mount("/ui", StaticFiles(directory=UI_DIR, html=True), name="ui")
