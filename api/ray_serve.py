"""loraplex on Ray Serve: several engine replicas behind one OpenAI endpoint, each adapter's
requests routed to the replicas that already hold it.

Three parts, and no router of our own (Ray Serve's model multiplexing routes):
- `Ingress`: the HTTP entry. It reads which adapter a request names (`model`, or `lora_name` for
  an admin load) and forwards the request as it came, with that adapter as the multiplexed
  model id, to an engine replica; the reply streams back as the replica wrote it. `/metrics`
  is every replica's, with a `replica` label.
- The engine replicas: `api/replica.py`'s `EngineReplica` (plain, tested without Ray) in a thin
  Ray deployment (`engine_replica`) whose multiplexing hook is the replica's `hold`.
- `AdapterCatalog`: one Ray actor with the shared adapter names (`SharedAdapters` for the app).
  Replicas report to it twice a second (their metrics, the catalog version they applied) and
  let go of names it no longer has, so an unload reaches every replica; the unload answers
  once every live replica has seen it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from loraplex.api import openai_format as fmt
from loraplex.api.flags import values
from loraplex.api.in_process import call_asgi
from loraplex.api.model_name import adapter_of
from loraplex.api.replica import EngineReplica
from loraplex.api.settings import ClusterConfig, ServerConfig
from loraplex.platform.engine_client import AdapterInfo

__all__ = ["AdapterCatalog", "ClusterConfig", "Ingress", "adapter_named", "build_application", "call_asgi",
           "engine_replica", "merge_metrics", "serve_ray"]

log = logging.getLogger(__name__)

REPLICA_SILENT_S = 10.0  # a replica not heard from for this long is gone (no longer waited for or listed)


# ---- the shared adapter names ------------------------------------------------------------------


@dataclass
class _Report:
    seen: float
    version: int
    metrics: str


class AdapterCatalog:
    """Adapter name -> where it is read from (an `AdapterInfo`), for every replica. Run as one
    async Ray actor."""

    def __init__(self, adapters: list[AdapterInfo]) -> None:
        self.adapters = {a.name: a for a in adapters}
        self.version = 0
        self.replicas: dict[str, _Report] = {}

    async def get(self, name: str) -> AdapterInfo | None:
        return self.adapters.get(name)

    async def list(self) -> list[AdapterInfo]:
        return list(self.adapters.values())

    async def register(self, info: AdapterInfo) -> bool:
        if info.name in self.adapters:
            return False
        self.adapters[info.name] = info
        self.version += 1
        return True

    async def unregister(self, name: str, wait_s: float = 10.0) -> bool:
        """Remove `name`; answers once every live replica has seen the removal (they let go of
        their copies as their requests on it end), or after `wait_s`."""
        if self.adapters.pop(name, None) is None:
            return False
        self.version += 1
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and any(r.version < self.version for r in self._live().values()):
            await asyncio.sleep(0.05)
        return True

    async def report(self, replica: str, version: int, metrics: str) -> tuple[int, list[AdapterInfo] | None]:
        """A replica's heartbeat: its metrics and the version it applied. Back: the current
        version, and the names when they changed since."""
        self.replicas[replica] = _Report(time.monotonic(), version, metrics)
        return self.version, (list(self.adapters.values()) if version != self.version else None)

    async def metrics(self) -> dict[str, str]:
        return {name: r.metrics for name, r in self._live().items()}

    def _live(self) -> dict[str, _Report]:
        now = time.monotonic()
        return {name: r for name, r in self.replicas.items() if now - r.seen < REPLICA_SILENT_S}


def merge_metrics(by_replica: dict[str, str]) -> bytes:
    """Each replica's Prometheus text as one exposition, every sample labelled with its replica."""
    families: dict[str, Metric] = {}
    for replica, text in sorted(by_replica.items()):
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            merged.samples += [s._replace(labels={**s.labels, "replica": replica}) for s in family.samples]

    class Collected:
        def collect(self):
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collected())
    return generate_latest(registry)


# ---- an engine replica ------------------------------------------------------------------------


def engine_replica(max_adapters: int):
    """The Ray deployment class around `EngineReplica`; Ray's multiplexing decorator takes its
    LRU bound at class creation."""
    from ray import serve

    class RayEngineReplica:
        def __init__(self, engine_args: dict, model: str | None, server: ServerConfig, catalog,
                     torch_threads: int) -> None:
            replica_id = serve.get_replica_context().replica_id.unique_id
            self.replica = start_replica(engine_args, model, server, catalog, torch_threads, replica_id,
                                         routed=lambda: bool(serve.get_multiplexed_model_id()))
            self.replica.hook = self.hold

        def __del__(self) -> None:
            replica = getattr(self, "replica", None)
            if replica is not None:
                replica.close()

        @serve.multiplexed(max_num_models_per_replica=max_adapters)
        async def hold(self, name: str):
            return await self.replica.hold(name)

        async def forward(self, request: dict, body: bytes, adapter: str | None):
            async for message in self.replica.forward(request, body, adapter):
                yield message

        async def check_health(self) -> None:
            await self.replica.check_health()

    return RayEngineReplica


def start_replica(engine_args: dict, model: str | None, server: ServerConfig, catalog, torch_threads: int,
                  replica_id: str, routed) -> EngineReplica:
    """An engine on this machine (the default model converted here when none is given) and its
    replica."""
    import torch

    from loraplex.platform.config import EngineConfig
    from loraplex.platform.engine_client import build_engine_client
    from loraplex.platform.model_store import materialize_default_model

    if torch_threads:
        torch.set_num_threads(torch_threads)
    model = model or str(materialize_default_model())  # each machine converts its own copy
    client = build_engine_client(EngineConfig(model=model, **engine_args), server.max_waiting_requests)
    return EngineReplica(client, server, catalog, replica_id, routed)


# ---- the ingress -----------------------------------------------------------------------------


def adapter_named(method: str, path: str, body: bytes, base: str) -> str | None:
    """The adapter a request is for: `model` of a generation request (`base:name` or `name`),
    `lora_name` of an admin load; None for the base model and everything else."""
    if method != "POST" or path not in ("/v1/chat/completions", "/v1/completions", "/v1/load_lora_adapter"):
        return None
    try:
        fields = json.loads(body)
        name = fields.get("lora_name" if path.endswith("load_lora_adapter") else "model")
    except (ValueError, AttributeError):  # the app answers malformed bodies itself
        return None
    if not isinstance(name, str):
        return None
    return adapter_of(name, base) or None


class Ingress:
    def __init__(self, engines, catalog, base: str, routing: str, max_body: int) -> None:
        self.engines, self.catalog = engines, catalog
        self.base, self.routing, self.max_body = base, routing, max_body

    async def __call__(self, request):
        from starlette.responses import Response, StreamingResponse

        if request.url.path == "/metrics":
            text = merge_metrics(await self.catalog.metrics.remote())
            return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body:
                message = f"request body larger than {self.max_body} bytes (max_request_body_bytes)"
                return Response(json.dumps(fmt.error_body(413, message)), 413, media_type="application/json")
        adapter = adapter_named(request.method, request.url.path, bytes(body), self.base)
        handle = self.engines.options(stream=True, multiplexed_model_id=(adapter or "") if self.routing == "adapter"
                                      else "")
        described = {"method": request.method, "path": request.url.path,
                     "query_string": request.url.query.encode(), "headers": request.headers.raw,
                     "client": list(request.client or ("127.0.0.1", 0))}
        replies = handle.forward.remote(described, bytes(body), adapter)
        try:
            start = await replies.__anext__()
        except Exception as exc:  # no replica could take it (all failed, or shutting down)
            log.error("request to the engine replicas failed: %r", exc)
            error = fmt.error_body(503, "no engine replica could serve the request; see the Ray Serve logs")
            return Response(json.dumps(error), 503, media_type="application/json")

        async def rest() -> AsyncIterator[bytes]:
            try:
                async for chunk in replies:
                    yield chunk
            finally:
                replies.cancel()  # the client left: the replica's app sees a disconnect and aborts

        response = StreamingResponse(rest(), status_code=start["status"])
        response.raw_headers = [(k, v) for k, v in start["headers"]]
        return response


# ---- building and running it -----------------------------------------------------------------


def build_application(engine_args: dict, model: str | None, server: ServerConfig, cluster: ClusterConfig,
                      adapters: list[AdapterInfo]):
    """The Ray Serve application (`serve.run` it): catalog actor, engine replicas, ingress."""
    import ray
    from ray import serve

    catalog = ray.remote(num_cpus=0)(AdapterCatalog).remote(adapters)
    replica = serve.deployment(engine_replica(cluster.max_adapters_per_replica), name="Engine",
                               **_replica_options(server, cluster))
    ingress = serve.deployment(Ingress, name="Ingress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024)
    engines = replica.bind(engine_args, model, server, catalog, int(cluster.replica_cpus))
    return ingress.bind(engines, catalog, server.served_model_name, cluster.routing, server.max_request_body_bytes)


def _replica_options(server: ServerConfig, cluster: ClusterConfig) -> dict:
    """The engine deployment's Ray options: resources, replica count or autoscaling, routing."""
    from ray.serve.config import RequestRouterConfig

    options: dict = {"ray_actor_options": {"num_cpus": cluster.replica_cpus},
                     "max_ongoing_requests": cluster.max_ongoing_requests, "health_check_period_s": 2,
                     "graceful_shutdown_timeout_s": server.shutdown_timeout_s}
    if cluster.max_replicas is not None and cluster.max_replicas > cluster.replicas:
        options["autoscaling_config"] = {"min_replicas": cluster.replicas, "max_replicas": cluster.max_replicas,
                                         "target_ongoing_requests": cluster.target_ongoing_requests}
    else:
        options["num_replicas"] = cluster.replicas
    if cluster.routing == "round-robin":
        options["request_router_config"] = RequestRouterConfig(
            request_router_class="ray.serve.experimental.round_robin_router:RoundRobinRouter")
    return options


def described_adapters(lora_modules: list[tuple[str, str]], engine_args: dict, model: str) -> list[AdapterInfo]:
    """`--lora-modules` read once here (a bad folder fails start-up, as on one server), so the
    catalog lists each with its rank and targets before any replica reads it."""
    from loraplex.platform.engine_client import read_adapter_info

    return [read_adapter_info(model, engine_args["max_lora_rank"], name, str(Path(path).resolve()))
            for name, path in lora_modules]


def serve_ray(args: argparse.Namespace) -> int:
    """`loraplex serve --ray`: a local Ray instance on loopback, or a running cluster
    (`--ray-address`), the application on it, until SIGTERM / SIGINT."""
    cluster = ClusterConfig(**values(ClusterConfig, args))  # nonsense is refused before Ray starts
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ValueError("--ray needs Ray Serve, the optional extra: pip install -e '.[ray]' (make setup-ray)") from None

    from loraplex.api.cli import engine_args, model_folder
    from loraplex.api.serve import server_config

    engine = engine_args(args)
    # replicas get None for the default model (each machine converts its own copy); checks here need a folder
    local_model = model_folder(args.model) if args.model else None
    model_for_checks = local_model or model_folder(None)
    server = server_config(args, model_for_checks)
    adapters = described_adapters(args.lora_modules, engine, model_for_checks)
    _start_ray(cluster)
    serve.start(http_options={"host": server.host, "port": server.port})
    serve.run(build_application(engine, local_model, server, cluster, adapters), name="loraplex", route_prefix="/",
              blocking=False)
    log.info("serving %r at %s/v1 on Ray Serve: %d replica(s), %s routing", server.served_model_name, server.url,
             cluster.replicas, cluster.routing)
    _wait_for_a_stop_signal()
    with contextlib.suppress(Exception):
        serve.delete("loraplex")
        if not cluster.address:
            serve.shutdown()
    ray.shutdown()
    return 0


def _start_ray(cluster: ClusterConfig) -> None:
    import ray

    if cluster.address:
        ray.init(address=cluster.address, namespace="loraplex", log_to_driver=False)
    else:  # this machine only, everything on loopback
        ray.init(address="local", namespace="loraplex", include_dashboard=False, log_to_driver=False,
                 _node_ip_address="127.0.0.1", num_cpus=cluster.num_cpus)


def _wait_for_a_stop_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
