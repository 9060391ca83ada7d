"""The adapters: GET /v1/adapters (the console's table; a tenant sees its own) and the admin
endpoints POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's bodies and answers; off
when the server has user keys and no admin key, api/tenancy/auth.py; a tenant with `can_load_adapters`
loads and unloads its own). Each load and unload goes to the audit log."""

from __future__ import annotations

import contextlib

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse

from loraplex.api.openai import openai_format as fmt
from loraplex.api.tenancy.admission import one_call
from loraplex.api.tenancy.auth import require_loader, require_user, sees_paths
from loraplex.api.tenancy.callers import caller_of
from loraplex.api.errors import APIError
from loraplex.api.openai.protocol import LoadAdapterRequest, UnloadAdapterRequest
from loraplex.api.state import ServerState, state_of

router = APIRouter()


MAX_PAGE = 1000


@router.get("/v1/adapters", dependencies=[Depends(require_user)])
async def adapters(request: Request, state: ServerState = Depends(state_of)):
    """loraplex's own: each registered adapter with its shape, where it is now (slot, CPU memory, its prepared
    file, its folder), what bringing it in cost, and what it served (the console's adapters view); its folder only
    for the admin. A tenant reads its own adapters with what they served it, and nothing of where they are
    (docs/tenants.md). `?search=` (a part of the name), `?offset=` and `?limit=` page them in load order."""
    caller = caller_of(request)
    search, offset, limit = _page_query(request)
    infos, page = fmt.adapter_page(await state.adapters.infos(caller), search, offset, limit)
    if caller.tenant is None:
        return {**fmt.adapter_list(infos, state.client.adapter_status(), state.metrics.by_adapter, sees_paths(request),
                                   state.adapters.objects.origin), **page}
    # named for a Ray ingress, which adds up this tenant's traffic from every replica (api/cluster/ray_serve.py)
    return {**fmt.adapter_list(infos, None, state.metrics.tenant_served(caller.tenant.name)),
            "tenant": caller.tenant.name, **page}


def _page_query(request: Request) -> tuple[str, int, int | None]:
    query = request.query_params
    search = query.get("search", "")
    values = {}
    for param in ("offset", "limit"):
        try:
            values[param] = int(query[param]) if param in query else None
        except ValueError:
            raise APIError(400, f"{param} must be a whole number", param) from None
    offset, limit = values["offset"] or 0, values["limit"]
    if offset < 0 or (limit is not None and not 1 <= limit <= MAX_PAGE):
        raise APIError(400, f"offset must be >= 0 and limit within 1..{MAX_PAGE}",
                       "limit" if limit is not None and not 1 <= limit <= MAX_PAGE else "offset")
    if len(search) > 256:
        raise APIError(400, "search is longer than 256 characters", "search")
    return search, offset, limit


@router.post("/v1/load_lora_adapter", dependencies=[Depends(require_loader)])
async def load_lora_adapter(body: LoadAdapterRequest, request: Request, state: ServerState = Depends(state_of)):
    async with _audited(request, state, "load_adapter", body.lora_name, lora_path=body.lora_path):
        with one_call(state, caller_of(request)):  # a load reads and checks a folder: a tenant's counts
            await state.adapters.load(body.lora_name, body.lora_path, caller_of(request))
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", dependencies=[Depends(require_loader)])
async def unload_lora_adapter(body: UnloadAdapterRequest, request: Request, state: ServerState = Depends(state_of)):
    async with _audited(request, state, "unload_adapter", body.lora_name):
        with one_call(state, caller_of(request)):
            await state.adapters.unload(body.lora_name, caller_of(request))
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


@contextlib.asynccontextmanager
async def _audited(request: Request, state: ServerState, action: str, name: str, **fields):
    """The action in the audit log, done or refused (with the status and why)."""
    by = caller_of(request).label
    try:
        yield
    except Exception as exc:  # an APIError, or an engine refusal the error handlers map (409 in use)
        status = exc.status if isinstance(exc, APIError) else None
        state.audit.write(action, by=by, name=name, ok=False, status=status, why=str(exc), **fields)
        raise
    state.audit.write(action, by=by, name=name, ok=True, **fields)
