"""Bearer keys and who holds them: the admin key (the operator's), the user key (`--api-key`),
tenants' keys (`--tenants`, api/tenancy/tenants.py), or anyone on a server without user keys. The user
endpoints need a key when a user key or tenants are configured; the adapter admin endpoints need
the admin key when one is set, and are off when user keys exist without it (a user key never
reaches them); a tenant with `can_load_adapters` loads its own adapters. Folder paths are shown
only to a caller the admin endpoints would let in. Each dependency records the `Caller`
(`request.state.caller`) and writes refusals to the audit log. Route dependencies."""

from __future__ import annotations

import hmac
import re

from fastapi import Request

from loraplex.api.batch import scope_keys
from loraplex.api.tenancy.callers import OPEN, Caller, caller_of
from loraplex.api.errors import APIError
from loraplex.api.state import ServerState, state_of

ADMIN_OFF = ("the adapter admin endpoints are off: the server has user keys (--api-key or --tenants) but no "
             "--admin-api-key (a user key never reaches them)")


# RFC 9110's optional whitespace (space, tab) is the only thing a key may carry around it and still match
_CREDENTIALS = re.compile(r"[ \t]*bearer[ \t]+(.*?)[ \t]*", re.ASCII | re.IGNORECASE | re.DOTALL)


def bearer(authorization: str) -> str | None:
    """The bearer token of an Authorization header exactly as sent, less spaces and tabs around it: a
    Unicode space, a control character or anything else that `str.strip` would also remove stays, so
    the key does not match."""
    found = _CREDENTIALS.fullmatch(authorization)
    return found.group(1) if found is not None and found.group(1) else None


def _token(request: Request) -> str | None:
    return bearer(request.headers.get("authorization", ""))


def may_use(state: ServerState, token: str | None, adapter: str) -> bool:
    """Whether the holder of `token` may use `adapter` (for what runs before the app answers: a Ray
    replica reading the adapter in)."""
    caller = identify(state, token)
    if caller is None:
        return not users_need_a_key(state)
    return caller.may_use(adapter)


def _same_key(given: str, key: str) -> bool:
    """Constant-time comparison of bytes: a header with non-ASCII characters is just a wrong key
    (comparing such strings directly raises)."""
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), key.encode("utf-8", "surrogateescape"))


def identify(state: ServerState, token: str | None) -> Caller | None:
    """The holder of `token`: the admin, the user key's user, a tenant; None for no or an unknown key."""
    if token is None:
        return None
    config = state.config
    if config.admin_api_key and _same_key(token, config.admin_api_key):
        return Caller("admin")
    if config.api_key and _same_key(token, config.api_key):
        return Caller("user")
    tenants = state.tenants.current
    tenant = tenants.identify(token) if tenants is not None else None
    return Caller("tenant", tenant) if tenant is not None else None


def users_need_a_key(state: ServerState) -> bool:
    return bool(state.config.api_key) or state.tenants.enabled


def admin_off(state: ServerState) -> bool:
    return users_need_a_key(state) and not state.config.admin_api_key


def _refuse(request: Request, status: int, message: str, who: Caller | None = None) -> APIError:
    state_of(request).audit.write("refused", status=status, route=request.url.path, method=request.method,
                                  caller=who.label if who is not None else "unknown key")
    return APIError(status, message)


def require_user(request: Request) -> None:
    # a request the app makes to itself (a batch line runs as its batch's creator): only in-process code
    # builds scopes, no header can set this key
    in_process = request.scope.get(scope_keys.CALLER)
    if isinstance(in_process, Caller):
        request.state.caller = in_process
        return
    state = state_of(request)
    caller = identify(state, _token(request))
    if caller is None:
        if users_need_a_key(state):
            raise _refuse(request, 401, "missing or invalid API key (Authorization: Bearer <key>)")
        caller = OPEN  # no key, on a server whose user endpoints need none
    request.state.caller = caller


def require_admin(request: Request) -> None:
    state = state_of(request)
    if admin_off(state):
        require_user(request)  # a wrong key is still a 401
        raise _refuse(request, 403, ADMIN_OFF, request.state.caller)
    if not state.config.admin_api_key:  # no keys at all: an open server
        request.state.caller = OPEN  # no key, on a server whose user endpoints need none
        return
    caller = identify(state, _token(request))
    if caller is not None and caller.role == "admin":
        request.state.caller = caller
        return
    if caller is not None:
        raise _refuse(request, 403, "this endpoint needs the admin API key", caller)
    raise _refuse(request, 401, "missing or invalid admin API key (Authorization: Bearer <key>)")


def require_loader(request: Request) -> None:
    """The adapter load / unload endpoints: the admin, or a tenant allowed to load its own adapters."""
    caller = identify(state_of(request), _token(request))
    if caller is not None and caller.tenant is not None and caller.tenant.can_load_adapters:
        request.state.caller = caller
        return
    require_admin(request)


def require_metrics(request: Request) -> None:
    """/metrics: open (Prometheus' habit) unless tenants or a metrics key are configured; then the admin key
    or the metrics key."""
    state = state_of(request)
    config = state.config
    if not state.tenants.enabled and not config.metrics_api_key:
        return
    token = _token(request)
    keys = [k for k in (config.admin_api_key, config.metrics_api_key) if k]
    if token is not None and any(_same_key(token, k) for k in keys):
        return
    who = identify(state, token)
    if who is not None:
        raise _refuse(request, 403, "/metrics needs the admin or the metrics API key", who)
    raise _refuse(request, 401, "missing or invalid metrics API key (Authorization: Bearer <key>)")


def sees_paths(request: Request) -> bool:
    """Whether the caller may see the server's folders: it holds the admin key, or the server has
    no keys at all (its admin endpoints are open to anyone)."""
    state = state_of(request)
    if admin_off(state):
        return False
    if not state.config.admin_api_key:
        return not state.tenants.enabled
    caller = identify(state, _token(request))
    return caller is not None and caller.role == "admin"


def shown(request: Request, text: str) -> str:
    """`text` as the caller may see it: the server's folders replaced by placeholders for anyone
    but the admin, a tenant's own adapter root left out of the paths under it."""
    return text if sees_paths(request) else state_of(request).redacted(text, caller_of(request))
