"""The operator's tenant endpoints (admin key): GET /v1/usage, what the usage ledger holds
(api/admin/ledger.py) per tenant, per adapter and per day, in a `?since=` / `?until=` window, and
POST /v1/reload_tenants, the tenants file read again (SIGHUP does the same through
`reload_tenants_now`)."""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Depends

from loraplex.api.admin.ledger import parse_time
from loraplex.api.tenancy.auth import require_admin
from loraplex.api.errors import APIError
from loraplex.api.state import ServerState, state_of
from loraplex.api.tenancy.tenants import Tenants, TenantsError

log = logging.getLogger(__name__)
router = APIRouter(dependencies=[Depends(require_admin)])


@router.get("/v1/usage")
async def usage(since: str | None = None, until: str | None = None, state: ServerState = Depends(state_of)):
    """`since` / `until`: unix seconds or ISO 8601 (UTC unless it says), `until` excluded."""
    window = []
    for value, param in ((since, "since"), (until, "until")):
        try:
            window.append(parse_time(value, param))
        except ValueError as exc:
            raise APIError(400, str(exc), param) from None
    return await asyncio.to_thread(state.ledger.usage, *window)


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
