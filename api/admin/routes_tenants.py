"""The operator's tenant endpoints (admin key): GET /v1/usage, token totals since start per tenant
and per adapter, and POST /v1/reload_tenants, the tenants file read again (SIGHUP does the same
through `reload_tenants_now`)."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Depends

from loraplex.api.tenancy.auth import require_admin
from loraplex.api.errors import APIError
from loraplex.api.state import ServerState, state_of
from loraplex.api.tenancy.tenants import Tenants, TenantsError

log = logging.getLogger(__name__)
router = APIRouter(dependencies=[Depends(require_admin)])


@router.get("/v1/usage")
async def usage(state: ServerState = Depends(state_of)):
    return state.metrics.usage()


@router.post("/v1/reload_tenants")
async def reload_tenants(state: ServerState = Depends(state_of)):
    try:
        tenants = reload_tenants_now(state, "admin")
    except TenantsError as exc:
        raise APIError(400, f"{exc}; the tenants in force are unchanged") from None
    return {"reloaded": True, "tenants": sorted(tenants.by_name)}


def reload_tenants_now(state: ServerState, by: str) -> Tenants:
    """The file read again and put in force; a TenantsError (logged, audited) keeps the old tenants."""
    try:
        tenants = state.tenants.reload()
    except TenantsError as exc:
        log.error("tenants not reloaded (%s): %s; the tenants in force are unchanged", by, exc)
        state.audit.write("reload_tenants", by=by, ok=False, why=str(exc))
        raise
    log.info("tenants reloaded (%s) from %s: %s", by, state.tenants.path, ", ".join(sorted(tenants.by_name)))
    state.audit.write("reload_tenants", by=by, ok=True, tenants=sorted(tenants.by_name))
    return tenants
