"""POST /v1/files (purpose "batch"), GET /v1/files, GET /v1/files/{id}, GET /v1/files/{id}/content,
DELETE /v1/files/{id}: OpenAI's Files API over the caller's own files.

An upload may be far larger than a generation request, so the body limit leaves this route alone
(api/body_limit.py) and it bounds the body itself while it reads it: the form's parts are counted as
they arrive and the upload stops with a 413 past `max_file_bytes` (plus the form's own few bytes),
before the body is read any further."""

from __future__ import annotations

import asyncio
import os
from typing import AsyncIterator, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from loraplex.api.batch import durable
from loraplex.api.batch.access import listing, owner, service_of
from loraplex.api.batch.service import BatchService
from loraplex.api.errors import APIError
from loraplex.api.tenancy.auth import require_user

router = APIRouter(dependencies=[Depends(require_user)])

FORM_BYTES = 64 << 10  # the form around the file: boundaries, part headers, the purpose field
PURPOSES = ("batch",)
MAX_FILENAME = 255


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the file is larger than {limit} bytes (max_file_bytes)", "file")


async def _bounded(stream: AsyncIterator[bytes], limit: int) -> AsyncIterator[bytes]:
    received = 0
    async for chunk in stream:
        received += len(chunk)
        if received > limit + FORM_BYTES:
            raise _too_large(limit)
        yield chunk


# the body this route reads itself, described for /openapi.json
UPLOAD_BODY = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "purpose"],
    "properties": {"file": {"type": "string", "format": "binary"},
                   "purpose": {"type": "string", "enum": list(PURPOSES)}}}}}}}


@router.post("/v1/files", openapi_extra=UPLOAD_BODY)
async def upload(request: Request, service: BatchService = Depends(service_of)):
    limit = service.config.max_file_bytes
    if not request.headers.get("content-type", "").lower().startswith("multipart/form-data"):
        raise APIError(400, "a file is uploaded as multipart/form-data with the fields `file` and `purpose`")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit + FORM_BYTES:
        raise _too_large(limit)
    parser = MultiPartParser(request.headers, _bounded(request.stream(), limit), max_files=1, max_fields=4,
                             max_part_size=FORM_BYTES)
    try:
        form = await parser.parse()
    except MultiPartException as exc:
        raise APIError(400, f"the upload is not a form this endpoint reads: {exc.message}") from None
    try:
        fields = [name for name, _ in form.multi_items()]
        for name in fields:
            if name not in ("file", "purpose") or fields.count(name) > 1:
                raise APIError(400, f"unexpected form field {name!r} (an upload has one `file` and one `purpose`)",
                               name)
        purpose, file = form.get("purpose"), form.get("file")
        if not isinstance(purpose, str):
            raise APIError(400, "purpose: a text field is required", "purpose")
        if purpose not in PURPOSES:
            raise APIError(400, f"purpose must be \"batch\" (the only files this server keeps), got {purpose!r}",
                           "purpose")
        if not isinstance(file, UploadFile):
            raise APIError(400, "file: a file part is required", "file")
        # a name that is not valid Unicode (lone surrogates) could not be answered: its bad characters replaced
        name = (file.filename or "upload.jsonl")[:MAX_FILENAME].encode("utf-8", "replace").decode("utf-8")
        try:
            stored = await asyncio.to_thread(service.files.add, owner(request), name, purpose,
                                             durable.read_chunks(file.file), limit)
        except durable.TooLarge:
            raise _too_large(limit) from None
    finally:
        await form.close()
    return stored.to_openai()


@router.get("/v1/files")
async def list_files(request: Request, after: str | None = None, limit: int = Query(10000, ge=1, le=10000),
                     order: Literal["asc", "desc"] = "desc", purpose: str | None = None,
                     service: BatchService = Depends(service_of)):
    files = service.files.list(owner(request), purpose)
    return listing(files if order == "desc" else files[::-1], after, limit)


def _file(request: Request, service: BatchService, file_id: str):
    stored = service.files.get(owner(request), file_id)
    if stored is None:  # another owner's file is as unknown as a missing one
        raise APIError(404, f"No such File object: {file_id}", "file_id")
    return stored


@router.get("/v1/files/{file_id}")
async def retrieve_file(file_id: str, request: Request, service: BatchService = Depends(service_of)):
    return _file(request, service, file_id).to_openai()


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, request: Request, service: BatchService = Depends(service_of)):
    stored = _file(request, service, file_id)
    try:
        handle = await asyncio.to_thread(service.files.open, stored)
    except FileNotFoundError:  # deleted meanwhile
        raise APIError(404, f"No such File object: {file_id}", "file_id") from None

    def chunks():
        with handle:
            yield from durable.read_chunks(handle)

    size = os.fstat(handle.fileno()).st_size  # of the content opened (a batch's files written again are whole)
    return StreamingResponse(chunks(), media_type="application/octet-stream", headers={"content-length": str(size)})


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, request: Request, service: BatchService = Depends(service_of)):
    _file(request, service, file_id)
    running = [b.id for b in service.batches.unfinished() if b.input_file_id == file_id]
    if running:  # its lines are read again after a restart: deleting it would fail the batch
        raise APIError(409, f"file {file_id} is the input of unfinished batch {running[0]}; delete it once the "
                            "batch is done or cancelled", "file_id")
    if not await asyncio.to_thread(service.files.delete, owner(request), file_id):
        raise APIError(404, f"No such File object: {file_id}", "file_id")
    return {"id": file_id, "object": "file", "deleted": True}
