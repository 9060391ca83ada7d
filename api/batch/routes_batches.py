"""POST /v1/batches, GET /v1/batches, GET /v1/batches/{id}, POST /v1/batches/{id}/cancel: OpenAI's
Batch API over the caller's own batches. The router's lifespan starts the batch service when the
app starts (resuming what a previous run left unfinished) and stops its runners when it stops."""

from __future__ import annotations

import contextlib
import json

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict, model_validator

from loraplex.api.batch.access import listing, owner, service_of
from loraplex.api.batch.batch_lines import ENDPOINTS
from loraplex.api.batch.service import BatchService
from loraplex.api.errors import APIError
from loraplex.api.tenancy.auth import require_user

MAX_METADATA = 16  # OpenAI's bounds on metadata
MAX_KEY, MAX_VALUE = 64, 512


@contextlib.asynccontextmanager
async def _lifespan(app):
    service = app.state.loraplex.batches
    if service is not None:
        service.start(app)
    try:
        yield
    finally:
        if service is not None:
            await service.stop()


router = APIRouter(dependencies=[Depends(require_user)], lifespan=_lifespan)


class CreateBatch(BaseModel):
    # as the generation bodies (api/openai/protocol.py): an unknown field is a 400 naming it, no coercion
    model_config = ConfigDict(extra="forbid", strict=True)

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        """JSON can carry lone surrogates ("\\ud800"), which no answer can encode: refused here."""
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("the body holds a string that is not valid Unicode (a lone surrogate)") from None
        return data


@router.post("/v1/batches")
async def create_batch(body: CreateBatch, request: Request, service: BatchService = Depends(service_of)):
    if body.endpoint not in ENDPOINTS:
        raise APIError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}, got {body.endpoint!r}", "endpoint")
    if body.completion_window != "24h":
        raise APIError(400, f"completion_window must be \"24h\", got {body.completion_window!r}", "completion_window")
    metadata = body.metadata
    if metadata is not None and (len(metadata) > MAX_METADATA or any(
            len(k) > MAX_KEY or len(v) > MAX_VALUE for k, v in metadata.items())):
        raise APIError(400, f"metadata holds at most {MAX_METADATA} pairs, keys of at most {MAX_KEY} characters and "
                            f"values of at most {MAX_VALUE}", "metadata")
    record = await service.create(owner(request), request.app, body.input_file_id, body.endpoint, metadata)
    return record.to_openai()


@router.get("/v1/batches")
async def list_batches(request: Request, after: str | None = None, limit: int = Query(20, ge=1, le=100),
                       service: BatchService = Depends(service_of)):
    return listing(service.batches.list(owner(request)), after, limit)


def _batch(request: Request, service: BatchService, batch_id: str):
    record = service.batches.get(owner(request), batch_id)
    if record is None:  # another owner's batch is as unknown as a missing one
        raise APIError(404, f"No such batch: {batch_id}", "batch_id")
    return record


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(batch_id: str, request: Request, service: BatchService = Depends(service_of)):
    return _batch(request, service, batch_id).to_openai()


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request, service: BatchService = Depends(service_of)):
    return (await service.cancel(_batch(request, service, batch_id))).to_openai()
