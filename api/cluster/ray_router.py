"""What Ray imports by path, each in its own process: `AdapterRouter`, the engine deployment's Ray Serve
request router, where `api/cluster/placement.py`'s `Placement` decides which replica takes a request, with
the adapters each replica holds as Ray's multiplexing reports them; and `proxy_middlewares`, for Ray's
HTTP proxy.

The router runs in the ingress's process, the engine replicas' only caller, so the loads it counts are
the cluster's. Ray imports it by its path (`ROUTER` in `api/cluster/ray_serve.py`) and ships it to that
process pickled by reference, which is why it is a module-level class. This module imports Ray, the
optional extra, at the top: nothing else imports it, and it imports nothing heavy (the proxy loads it)."""

from __future__ import annotations

import json

from ray.serve.request_router import RequestRouter
from starlette.middleware import Middleware

from loraplex.api.cluster.placement import LOAD_EPSILON, Placement, request_tokens


class AdapterRouter(RequestRouter):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.placement = Placement()

    def initialize_state(self, epsilon: float | None = LOAD_EPSILON, **_) -> None:
        self.placement.epsilon = epsilon

    def update_replicas(self, replicas) -> None:
        super().update_replicas(replicas)
        self.placement.sync({r.replica_id.unique_id: set(r.multiplexed_model_ids) for r in replicas})

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        if pending_request is None:  # a routing task with nothing left to route
            return [candidate_replicas]
        pending_request.routing_context.should_backoff = True  # all full: wait before trying again
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        meta = pending_request.metadata
        order = self.placement.choose(meta.internal_request_id, meta.multiplexed_model_id or None,
                                      request_tokens(_body(pending_request)))
        return [[by_id[r]] for r in order if r in by_id]

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        meta = pending_request.metadata
        self.placement.dispatched(meta.internal_request_id, replica_id.unique_id,
                                  meta.multiplexed_model_id or None)

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        self.placement.finished(internal_request_id, replica_id.unique_id)


def _body(pending_request) -> bytes:
    """The request body the ingress passed to the replica's `forward(request, body, adapter)`."""
    body = pending_request.args[1] if len(pending_request.args) > 1 else b""
    return body if isinstance(body, bytes) else b""


# ---- Ray's HTTP proxy ------------------------------------------------------------------------

# what `fmt.error_body(503, ...)` writes, spelled out: that module imports the engine's values (torch),
# too heavy for the proxy's process
UNANSWERED = json.dumps({"error": {"message": "the request was lost: the server's ingress failed (it is restarted); "
                                              "try again", "type": "ServiceUnavailableError", "param": None,
                                   "code": 503}}).encode()


def proxy_middlewares() -> list[Middleware]:
    """The middlewares of Ray's HTTP proxy (`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH` names this
    function: `api/cluster/ray_serve.py`)."""
    return [Middleware(AnswerTheUnanswered)]


class AnswerTheUnanswered:
    """A request the proxy ends without any answer (the ingress died under it: Ray's proxy then sends
    nothing, and its server a bare 500) gets a 503 in OpenAI's shape. A response already started
    is left as it is: its connection ends without the rest."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watched(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, receive, watched)
        if not started:
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(UNANSWERED)).encode())]
            await send({"type": "http.response.start", "status": 503, "headers": headers})
            await send({"type": "http.response.body", "body": UNANSWERED})
