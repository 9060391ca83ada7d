"""The caller a batch's lines run as, from its owner as kept on disk (`Caller.owner`: a tenant by
name, "tenant:acme", anyone else by role, "admin", "user", "open"; the prefix keeps a tenant named
"admin" apart from the admin). A batch's lines run as its owner as the tenants file says now (a
reload's new limits apply to lines not yet run); a tenant removed since has no caller, and its
remaining lines are refused."""

from __future__ import annotations

from loraplex.api.tenancy.callers import Caller
from loraplex.api.tenancy.tenants import TenantRegistry

_TENANT = "tenant:"


def caller_for(owner: str, tenants: TenantRegistry) -> Caller | None:
    """The owner's caller now; None for a tenant no longer in the tenants file."""
    if not owner.startswith(_TENANT):
        return Caller(owner)
    current = tenants.current
    tenant = current.by_name.get(owner[len(_TENANT):]) if current is not None else None
    return Caller("tenant", tenant) if tenant is not None else None
