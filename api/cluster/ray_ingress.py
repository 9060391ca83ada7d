"""`Ingress`: the Ray Serve application's HTTP entry (a deployment, `api/cluster/ray_serve.py`).

It reads which adapter a request names (`model`, the heaviest of an `adapters` mix, or `lora_name`
for an admin load) and forwards the request as it came, with that adapter as the multiplexed model
id, to an engine replica. Which replica: the engine deployment's request router
(`api/cluster/ray_router.py`). A stream is passed back chunk by chunk (a replica dying mid-stream ends
it with an error event, no `[DONE]`); any other answer is read whole first, so a replica dying
before it is done is a 503, never a cut body. `/health` (the ingress is up) and `/ready` (every
replica the deployment wants is ready, as the replicas report to the catalog, and reached through
this ingress's router) are answered here. A few answers are the cluster's, not one replica's
(`Ingress.after`): once a replica has answered 200 (it checked the caller), `/metrics`,
`/v1/stats` and `/v1/adapters` are merged over the replicas' heartbeats (`api/cluster/ray_merge.py`;
`/v1/usage` is the replica's own answer, read from the cluster's one ledger), and a tenants reload
is passed on to the other replicas through the catalog.
Ray reaches it only through the handles it is given: a plain class."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import AsyncIterator

from starlette.responses import Response, StreamingResponse

from loraplex.api.openai import openai_format as fmt
from loraplex.api.openai.model_name import adapter_of
from loraplex.api.cluster.ray_catalog import Readiness
from loraplex.api.cluster.ray_merge import merge_metrics, merged_view
from loraplex.platform.engine.engine_client import parse_mix

__all__ = ["Ingress", "adapter_named"]

log = logging.getLogger(__name__)

PROBE_S = 2.0  # how long `/ready` waits for the replicas' answers through the router (a busy one is slow)
LOAD_WAIT_S = 60.0  # how long an admin load waits for the cluster to be ready before it goes ahead
LOAD_POLL_S = 0.5  # meanwhile, how often it asks


# ---- which adapter a request is routed by ---------------------------------------------------


def _generation(fields: dict):
    if fields.get("adapters") is not None:  # a mix: `model` names the base
        return _heaviest(fields["adapters"])
    return fields.get("model")


def _admin_load(fields: dict):
    return fields.get("lora_name")


# POST path -> the body field that names the adapter; every other request is routed as the base model
ROUTED_BY = {"/v1/chat/completions": _generation, "/v1/completions": _generation, "/v1/responses": _generation,
             "/v1/load_lora_adapter": _admin_load}


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
    def __init__(self, engines, catalog, base: str, routing: str, max_body: int, replicas: int = 1) -> None:
        """`replicas`: the engine replicas the deployment wants (the autoscaler's minimum)."""
        self.engines, self.catalog = engines, catalog
        self.base, self.routing, self.max_body, self.wanted = base, routing, max_body, replicas
        self.loads_wait = True  # until the cluster was ready (or one load waited long enough)
        # answered here, whatever the replicas' state: liveness is the ingress's, readiness the cluster's
        self.own = {("GET", "/health"): self._alive, ("GET", "/ready"): self._ready}
        # a replica's 200 to these (method, path) is the cluster's business; an entry answers, or
        # returns None to pass the replica's answer on
        self.after = {("GET", "/metrics"): self._metrics, ("GET", "/v1/stats"): self._merged,
                      ("GET", "/v1/adapters"): self._merged,
                      ("POST", "/v1/reload_tenants"): self._tenants_reloaded}

    async def __call__(self, request):
        own = self.own.get((request.method, request.url.path))
        if own is not None:
            return await own()
        body = await self._read_body(request)
        if body is None:
            message = f"request body larger than {self.max_body} bytes (max_request_body_bytes)"
            return _json_response(fmt.error_body(413, message), 413)
        path = request.url.path
        if (request.method, path) == ("POST", "/v1/load_lora_adapter"):
            await self._until_ready()
        replies = self._forward(request, body, adapter_named(request.method, path, body, self.base))
        try:
            start = await replies.__anext__()
            # a whole answer is read before its status is sent: a replica dying meanwhile is a 503,
            # never a 200 with a cut body
            whole = None if _is_stream(start) else await _drained(replies)
        except Exception as exc:  # no replica could take it (all failed, or shutting down), or it died
            log.error("request to the engine replicas failed: %r", exc)
            error = fmt.error_body(503, "no engine replica could serve the request; see the Ray Serve logs")
            return _json_response(error, 503)
        if whole is None:
            return _streamed_on(start, replies)
        after = self.after.get((request.method, path)) if start["status"] == 200 else None
        answer = await after(path, whole) if after is not None else None
        return answer if answer is not None else _whole(start, whole)

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

    # ---- liveness and readiness

    async def _alive(self) -> Response:
        return Response(status_code=200)

    async def _ready(self) -> Response:
        """200 once every replica the deployment wants is ready and this ingress's router reaches it;
        else 503 saying how many are."""
        readiness = await self._readiness()
        if not readiness.ready:
            return _json_response(fmt.error_body(503, readiness.message), 503)
        return _json_response({"ready": True, "replicas_ready": readiness.replicas_ready,
                               "replicas_wanted": readiness.replicas_wanted}, 200)

    async def _readiness(self) -> Readiness:
        return await self.catalog.readiness.remote(await self._reached(), self.wanted)

    async def _reached(self) -> list[str]:
        """The engine replicas this ingress's router knows, each asked through it: a replica Ray has
        not yet told the router about gets no request, and placement would not count it."""
        try:
            answers = await self.engines.broadcast("reached").results_async(timeout_s=PROBE_S, return_exceptions=True)
        except Exception:  # none known yet, or none answered in time
            return []
        return [answer for answer in answers if isinstance(answer, str)]

    async def _until_ready(self) -> None:
        """An admin load waits (a while) for the cluster to be ready: placed before every replica is
        known, it would land on the first one up and stay there. Once it was, or once a load waited
        the whole while (a replica that cannot start), loads go ahead at once."""
        deadline = time.monotonic() + LOAD_WAIT_S
        while self.loads_wait and time.monotonic() < deadline and not (await self._readiness()).ready:
            await asyncio.sleep(LOAD_POLL_S)
        self.loads_wait = False

    # ---- the cluster's answers after a replica's

    async def _metrics(self, path: str, whole: bytes) -> Response:
        # the caller is allowed (the replica said): every replica's metrics
        return Response(merge_metrics(await self.catalog.metrics.remote()),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    async def _merged(self, path: str, whole: bytes) -> Response:
        reply = json.loads(whole)  # the replica's answer says who asked
        return _json_response(merged_view(path, reply, await self.catalog.views.remote()), 200)

    async def _tenants_reloaded(self, path: str, whole: bytes) -> None:
        await self.catalog.tenants_reloaded.remote()  # the other replicas follow on their heartbeat


def _is_stream(start: dict) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in start["headers"])


async def _drained(replies) -> bytes:
    return b"".join([chunk async for chunk in replies])


def _whole(start: dict, body: bytes) -> Response:
    response = Response(body, start["status"])
    response.raw_headers = [(k, v) for k, v in start["headers"]]
    return response


def _streamed_on(start: dict, replies) -> StreamingResponse:
    """The replica's stream passed on as it writes it. Its status line is sent, so a replica dying
    mid-stream ends it with an error event in OpenAI's shape and no `[DONE]`: never as if complete."""

    async def rest() -> AsyncIterator[bytes]:
        try:
            async for chunk in replies:
                yield chunk
        except Exception as exc:
            log.error("the engine replica serving a stream failed: %r", exc)
            yield fmt.sse(fmt.error_body(503, "the engine replica serving this stream failed; "
                                              "see the Ray Serve logs")).encode()
        finally:
            replies.cancel()  # the client left: the replica's app sees a disconnect and aborts

    response = StreamingResponse(rest(), status_code=start["status"])
    response.raw_headers = [(k, v) for k, v in start["headers"]]
    return response


def _json_response(body: dict, status: int) -> Response:
    return Response(json.dumps(body), status, media_type="application/json")
