"""Who is calling: the admin key, the user key, a tenant's key, or anyone (a server without keys).
`api/tenancy/auth.py` decides it once per request (`request.state.caller`); routes ask what it may see."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from loraplex.api.tenancy.tenants import Tenant
from loraplex.platform.engine.engine_client import TenantShare


@dataclass(frozen=True)
class Caller:
    role: str  # "admin", "user", "tenant" or "open"
    tenant: Tenant | None = None

    def may_use(self, adapter: str | None) -> bool:
        """The base model (None) or an adapter: everything for callers other than tenants."""
        return self.tenant is None or self.tenant.may_use(adapter)

    @property
    def share(self) -> TenantShare | None:
        """Its share of the engine's batch and its prefix-cache namespace (tenants only)."""
        if self.tenant is None:
            return None
        return TenantShare(self.tenant.name, self.tenant.weight, self.tenant.cache_namespace)

    @property
    def owner(self) -> str:
        """Whose stored objects (responses, files, batches) these are: a tenant's own, else the role's."""
        return f"tenant:{self.tenant.name}" if self.tenant is not None else self.role

    @property
    def label(self) -> str:
        """For logs, metrics and the audit log: the tenant's name, else the role."""
        return self.tenant.name if self.tenant is not None else self.role


OPEN = Caller("open")


def caller_of(request: Request) -> Caller:
    return getattr(request.state, "caller", None) or OPEN
