"""One batch line as a request the app makes to itself, in-process (no socket, no key): the route
that answers it is the online route, so its validation, error bodies, tenant limits, usage billing
and metrics are exactly an online call's. The scope says who calls (`scope_keys.CALLER`: the batch's
owner; only in-process code builds scopes, so no client can claim it) and that it is a batch line
(`scope_keys.BATCH_LINE`: the generation routes run it at the lowest scheduling priority)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from loraplex.api.batch.scope_keys import BATCH_LINE, CALLER
from loraplex.api.cluster.in_process import call_asgi
from loraplex.api.openai.openai_format import error_body
from loraplex.api.tenancy.callers import Caller


@dataclass(frozen=True)
class Answer:
    status: int
    body: dict
    retry_after: float | None = None  # seconds, from a 429's or 503's Retry-After


async def call_line(app, caller: Caller, path: str, body: dict) -> Answer:
    """POST `body` to `path` of `app` as `caller`; the whole answer."""
    payload = json.dumps(body).encode()

    async def as_batch_line(scope, receive, send):
        await app({**scope, CALLER: caller, BATCH_LINE: True}, receive, send)

    request = {"method": "POST", "path": path, "query_string": b"", "client": ("127.0.0.1", 0),
               "headers": [(b"host", b"batch"), (b"content-type", b"application/json"),
                           (b"content-length", str(len(payload)).encode())]}
    status, headers, chunks = None, [], []
    async for message in call_asgi(as_batch_line, request, payload, []):
        if isinstance(message, dict):
            status, headers = message["status"], message["headers"]
        else:
            chunks.append(message)
    if status is None:
        return Answer(500, error_body(500, "the server gave no answer to this line; see the server log"))
    return Answer(status, _json(status, b"".join(chunks)), _retry_after(headers))


def _json(status: int, raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if isinstance(body, dict):
        return body
    return error_body(status, raw.decode("utf-8", "replace")[:2000] or f"HTTP {status} without a body")


def _retry_after(headers: list[tuple[bytes, bytes]]) -> float | None:
    for key, value in headers:
        if key.lower() == b"retry-after":
            try:
                return max(0.0, float(value))
            except ValueError:
                return None
    return None
