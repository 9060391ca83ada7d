"""`Ingress`: the Ray Serve application's HTTP entry (a deployment, `api/cluster/ray_serve.py`).

It reads which adapter a request names (`model`, the heaviest of an `adapters` mix, or `lora_name`
for an admin load) and forwards the request as it came, with that adapter as the multiplexed model
id, to an engine replica; the reply streams back as the replica wrote it. Which replica: the engine
deployment's request router (`api/cluster/ray_router.py`). A few answers are the cluster's, not one
replica's (`Ingress.after`): once a replica has answered 200 (it checked the caller), `/metrics`,
`/v1/stats`, `/v1/adapters` and `/v1/usage` are merged over the replicas' heartbeats
(`api/cluster/ray_merge.py`), and a tenants reload is passed on to the other replicas through the catalog.
Ray reaches it only through the handles it is given: a plain class."""

from __future__ import annotations

import json
import logging
from typing import AsyncIterator

from starlette.responses import Response, StreamingResponse

from loraplex.api.openai import openai_format as fmt
from loraplex.api.openai.model_name import adapter_of
from loraplex.api.cluster.ray_merge import merge_metrics, merged_view
from loraplex.platform.engine.engine_client import parse_mix

__all__ = ["Ingress", "adapter_named"]

log = logging.getLogger(__name__)


# ---- which adapter a request is routed by ---------------------------------------------------


def _generation(fields: dict):
    if fields.get("adapters") is not None:  # a mix: `model` names the base
        return _heaviest(fields["adapters"])
    return fields.get("model")


def _admin_load(fields: dict):
    return fields.get("lora_name")


# POST path -> the body field that names the adapter; every other request is routed as the base model
ROUTED_BY = {"/v1/chat/completions": _generation, "/v1/completions": _generation, "/v1/load_lora_adapter": _admin_load}


def adapter_named(method: str, path: str, body: bytes, base: str) -> str | None:
    """The adapter a request is routed by: `model` of a generation request (`base:name` or
    `name`), or the heaviest adapter of its `adapters` mix; `lora_name` of an admin load; None
    for the base model and everything else."""
    named = ROUTED_BY.get(path) if method == "POST" else None
    if named is None:
        return None
    try:
        name = named(json.loads(body))
    except (ValueError, AttributeError):  # the app answers malformed bodies itself
        return None
    if not isinstance(name, str):
        return None
    return adapter_of(name, base) or None


def _heaviest(mix) -> str | None:
    """The mix's heaviest adapter as the engine's mix parser names it (`AdapterMix.heaviest`); None
    when the mix is malformed: routed as the base model, and the replica's app answers the 400."""
    if not isinstance(mix, list) or not all(isinstance(entry, dict) for entry in mix):
        return None
    pairs = [(entry.get("name"), entry.get("weight", 1.0)) for entry in mix]
    try:  # the count limit is the replica's to enforce, with its own setting
        return parse_mix(pairs, max_adapters=len(pairs), field="adapters").heaviest
    except ValueError:
        return None


# ---- the ingress ----------------------------------------------------------------------------


class Ingress:
    def __init__(self, engines, catalog, base: str, routing: str, max_body: int) -> None:
        self.engines, self.catalog = engines, catalog
        self.base, self.routing, self.max_body = base, routing, max_body
        # a replica's 200 to these (method, path) is the cluster's business; an entry answers, or
        # returns None to pass the replica's answer on
        self.after = {("GET", "/metrics"): self._metrics, ("GET", "/v1/stats"): self._merged,
                      ("GET", "/v1/adapters"): self._merged, ("GET", "/v1/usage"): self._merged,
                      ("POST", "/v1/reload_tenants"): self._tenants_reloaded}

    async def __call__(self, request):
        body = await self._read_body(request)
        if body is None:
            message = f"request body larger than {self.max_body} bytes (max_request_body_bytes)"
            return _json_response(fmt.error_body(413, message), 413)
        path = request.url.path
        replies = self._forward(request, body, adapter_named(request.method, path, body, self.base))
        try:
            start = await replies.__anext__()
        except Exception as exc:  # no replica could take it (all failed, or shutting down)
            log.error("request to the engine replicas failed: %r", exc)
            error = fmt.error_body(503, "no engine replica could serve the request; see the Ray Serve logs")
            return _json_response(error, 503)
        after = self.after.get((request.method, path)) if start["status"] == 200 else None
        answer = await after(path, replies) if after is not None else None
        return answer if answer is not None else _passed_on(start, replies)

    async def _read_body(self, request) -> bytes | None:
        """The whole body, or None once it grows past `max_body`."""
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body:
                return None
        return bytes(body)

    def _forward(self, request, body: bytes, adapter: str | None):
        """The request to an engine replica (chosen by the router, with `adapter` as the multiplexed
        model id unless routing is adapter-blind); its replies: the start, then the body's chunks."""
        model_id = (adapter or "") if self.routing != "round-robin" else ""
        handle = self.engines.options(stream=True, multiplexed_model_id=model_id)
        described = {"method": request.method, "path": request.url.path,
                     "query_string": request.url.query.encode(), "headers": request.headers.raw,
                     "client": list(request.client or ("127.0.0.1", 0))}
        return handle.forward.remote(described, body, adapter)

    async def _metrics(self, path: str, replies) -> Response:
        await _drained(replies)  # the caller is allowed (the replica said): every replica's metrics
        return Response(merge_metrics(await self.catalog.metrics.remote()),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    async def _merged(self, path: str, replies) -> Response:
        reply = json.loads(await _drained(replies))  # the replica's answer says who asked
        return _json_response(merged_view(path, reply, await self.catalog.views.remote()), 200)

    async def _tenants_reloaded(self, path: str, replies) -> None:
        await self.catalog.tenants_reloaded.remote()  # the other replicas follow on their heartbeat


async def _drained(replies) -> bytes:
    return b"".join([chunk async for chunk in replies])


def _passed_on(start: dict, replies) -> StreamingResponse:
    """The replica's answer streamed back as it wrote it."""

    async def rest() -> AsyncIterator[bytes]:
        try:
            async for chunk in replies:
                yield chunk
        finally:
            replies.cancel()  # the client left: the replica's app sees a disconnect and aborts

    response = StreamingResponse(rest(), status_code=start["status"])
    response.raw_headers = [(k, v) for k, v in start["headers"]]
    return response


def _json_response(body: dict, status: int) -> Response:
    return Response(json.dumps(body), status, media_type="application/json")
