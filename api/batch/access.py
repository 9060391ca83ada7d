"""What the Files and Batch routes depend on: the server's batch service (a 403 saying why when
the server keeps none) and the owner the caller's files and batches are kept under."""

from __future__ import annotations

from fastapi import Request

from loraplex.api.batch.service import BatchService
from loraplex.api.errors import APIError
from loraplex.api.state import state_of
from loraplex.api.tenancy.callers import caller_of

OFF = ("the Files and Batch APIs are off on this server: it keeps no batch folder (batch_dir; `loraplex serve` "
       "keeps one, but not under --ray, where each replica would keep its own files and batches)")


def service_of(request: Request) -> BatchService:
    service = state_of(request).batches
    if service is None:
        raise APIError(403, OFF)
    return service


def owner(request: Request) -> str:
    return caller_of(request).owner


def listing(items: list, after: str | None, limit: int) -> dict:
    """OpenAI's cursor page of `items` (objects with an `id`, in the listing's order): the `limit`
    after the one whose id is `after` (an id not among them, deleted or never there: an empty page,
    which ends a client's paging rather than starting it over)."""
    ids = [item.id for item in items]
    if after is None:
        start = 0
    else:
        start = ids.index(after) + 1 if after in ids else len(ids)
    page = items[start:start + limit]
    data = [item.to_openai() for item in page]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": start + limit < len(items)}
