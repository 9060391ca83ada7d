"""Bearer keys: the user key opens /v1/*, /tokenize and /detokenize (the admin key does too);
the adapter admin endpoints need the admin key when one is set. Route dependencies."""

from __future__ import annotations

import hmac

from fastapi import Request

from loraplex.api.errors import APIError
from loraplex.api.state import state_of


def _token(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _same_key(given: str, key: str) -> bool:
    """Constant-time comparison of bytes: a header with non-ASCII characters is just a wrong key
    (comparing such strings directly raises)."""
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), key.encode("utf-8", "surrogateescape"))


def require_user(request: Request) -> None:
    config = state_of(request).config
    if not config.api_key:
        return
    token = _token(request)
    keys = [k for k in (config.api_key, config.admin_api_key) if k]
    if token is None or not any(_same_key(token, k) for k in keys):
        raise APIError(401, "missing or invalid API key (Authorization: Bearer <key>)")


def require_admin(request: Request) -> None:
    config = state_of(request).config
    if not config.admin_api_key:
        return require_user(request)
    token = _token(request)
    if token is not None and _same_key(token, config.admin_api_key):
        return
    if token is not None and config.api_key and _same_key(token, config.api_key):
        raise APIError(403, "this endpoint needs the admin API key")
    raise APIError(401, "missing or invalid admin API key (Authorization: Bearer <key>)")
