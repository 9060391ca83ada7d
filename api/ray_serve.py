"""loraplex on Ray Serve: several engine replicas behind one OpenAI endpoint, each adapter's
requests routed to the replicas that already hold it.

Three parts, and no router of our own (Ray Serve's model multiplexing routes):
- `Ingress`: the HTTP entry. It reads which adapter a request names (`model`, or `lora_name` for
  an admin load) and forwards the request as it came, with that adapter as the multiplexed
  model id, to an engine replica; the reply streams back as the replica wrote it. `/metrics`
  is every replica's, with a `replica` label.
- `EngineReplica`: one engine with the same FastAPI app as `loraplex serve` (`build_app`: same
  routes, validation, auth, errors, SSE), called in-process through ASGI. Its multiplexing hook
  reads an adapter on first use (LRU over `max_adapters_per_replica`, the evicted one unloaded
  once its requests end). Replies carry `x-loraplex-replica` and, for adapter requests,
  `x-loraplex-adapter-cache: hit|miss` (miss: its weights had to be read here).
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
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from loraplex.adapters.registry import AdapterInfo, AdapterInUseError, UnknownAdapterError
from loraplex.api import openai_format as fmt
from loraplex.api.server import ServerConfig, build_app

log = logging.getLogger("loraplex.ray")

REPLICA_HEADER = "x-loraplex-replica"
CACHE_HEADER = "x-loraplex-adapter-cache"
ROUTINGS = ("adapter", "round-robin")  # round-robin: Ray's RoundRobinRouter, adapter-blind (the baseline)
REPORT_INTERVAL_S = 0.5
REPLICA_SILENT_S = 10.0  # a replica not heard from for this long is gone (no longer waited for or listed)


@dataclass(frozen=True)
class ClusterConfig:
    replicas: int = 2
    max_replicas: int | None = None  # above `replicas`: autoscale between the two
    target_ongoing_requests: int = 16  # per replica, what the autoscaler aims at
    max_adapters_per_replica: int = 16  # Ray's max_num_models_per_replica
    routing: str = "adapter"
    replica_cpus: float = 1.0  # Ray CPUs per engine replica; also its torch threads
    max_ongoing_requests: int = 256  # per replica: the engine batches, Ray should not queue in front of it
    shutdown_timeout_s: float = 30.0  # a replica being stopped lets its requests finish this long

    def __post_init__(self) -> None:
        if self.replicas < 1 or (self.max_replicas is not None and self.max_replicas < self.replicas):
            raise ValueError(f"need 1 <= replicas <= max_replicas, got {self.replicas}, {self.max_replicas}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {self.routing!r}")
        if self.max_adapters_per_replica < 1 or self.replica_cpus < 0:
            raise ValueError("max_adapters_per_replica must be >= 1 and replica_cpus >= 0")


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


class _CatalogClient:
    """The app's `SharedAdapters`, over the catalog actor. Names the replica's heartbeat last
    brought are answered here; others (registered since) are asked for."""

    def __init__(self, catalog) -> None:
        self.catalog = catalog
        self.known: dict[str, AdapterInfo] = {}

    def update(self, adapters: list[AdapterInfo]) -> None:
        self.known = {a.name: a for a in adapters}

    async def get(self, name: str) -> AdapterInfo | None:
        info = self.known.get(name)
        if info is None:
            info = await self.catalog.get.remote(name)
        return info

    async def list(self) -> list[AdapterInfo]:
        return await self.catalog.list.remote()

    async def register(self, info: AdapterInfo) -> bool:
        return await self.catalog.register.remote(info)

    async def unregister(self, name: str) -> bool:
        return await self.catalog.unregister.remote(name)


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


async def call_asgi(app, request: dict, body: bytes, headers: list[tuple[bytes, bytes]]) -> AsyncIterator[Any]:
    """Run one HTTP request through an ASGI app in-process: first {"status", "headers"} (plus
    `headers`), then the body's chunks as the app sends them. Closed early (the client left),
    the app sees a disconnect, which aborts what the request started."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http",
             "method": request["method"], "path": request["path"], "raw_path": request["path"].encode(),
             "root_path": "", "query_string": request["query_string"], "headers": request["headers"],
             "client": tuple(request["client"]), "server": ("127.0.0.1", 0)}
    sent: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_read = False

    async def receive() -> dict:
        nonlocal body_read
        if not body_read:
            body_read = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    app_task = asyncio.ensure_future(app(scope, receive, sent.put))
    app_task.add_done_callback(lambda _: sent.put_nowait(None))
    try:
        while (message := await sent.get()) is not None:
            if message["type"] == "http.response.start":
                yield {"status": message["status"], "headers": [*message.get("headers", []), *headers]}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body"):
                    break
    finally:
        gone.set()
        if not app_task.done():
            await asyncio.wait({app_task}, timeout=5)
            app_task.cancel()


def engine_replica(max_adapters: int):
    """The replica class; Ray's multiplexing decorator takes its LRU bound at class creation."""
    from ray import serve

    class EngineReplica:
        def __init__(self, engine_args: dict, model: str | None, server_config: ServerConfig, catalog,
                     torch_threads: int, max_waiting_requests: int | None) -> None:
            import torch

            from loraplex.platform.async_engine import AsyncEngine
            from loraplex.platform.config import EngineConfig
            from loraplex.platform.engine import Engine
            from loraplex.platform.model_store import materialize_default_model

            if torch_threads:
                torch.set_num_threads(torch_threads)
            model = model or str(materialize_default_model())  # each machine converts its own copy
            self.front = AsyncEngine(Engine(EngineConfig(model=model, **engine_args)),
                                     max_waiting_requests=max_waiting_requests)
            self.catalog = catalog
            self.shared = _CatalogClient(catalog)
            self.app = build_app(self.front, server_config, self.shared)
            self.server = self.app.state.server
            self.replica = serve.get_replica_context().replica_id.unique_id
            self.id_header = (REPLICA_HEADER.encode(), self.replica.encode())
            self.held: set[str] = set()  # names Ray's multiplexing LRU holds here
            self.metrics = CollectorRegistry(auto_describe=False)
            self.metrics.register(_LoadedAdapters(self.front.adapters))
            self.misses = Counter("loraplex:adapter_cache_misses", "Adapter requests whose weights this replica "
                                  "had to read first.", registry=self.metrics)
            self.version = -1
            self.loop: asyncio.AbstractEventLoop | None = None
            self.reporter: asyncio.Task | None = None

        def __del__(self) -> None:
            front = getattr(self, "front", None)
            if front is not None:
                front.shutdown()

        @serve.multiplexed(max_num_models_per_replica=max_adapters)
        async def hold(self, name: str) -> "_Held":
            """Ray's multiplexing hook: read the adapter here (the app's own first-use load, so
            confinement and errors are the server's), and tell Ray this replica has it."""
            await self.server.resolve_model(name)
            self.held.add(name)
            return _Held(self, name)

        async def forward(self, request: dict, body: bytes, adapter: str | None) -> AsyncIterator[Any]:
            self._start_reporting()
            loading = request["path"] == "/v1/load_lora_adapter"
            was_here = adapter is not None and self._in_memory(adapter)
            if adapter is not None and not loading and serve.get_multiplexed_model_id():
                with contextlib.suppress(Exception):  # unknown or bad: the app answers the request with it
                    await self.hold(adapter)
            status = None
            async for message in call_asgi(self.app, request, body, [self.id_header]):
                if isinstance(message, dict):
                    status = message["status"]
                    if adapter is not None and not loading:  # the app has resolved (read) the adapter by now
                        message["headers"].extend(self._cache_header(adapter, was_here))
                yield message
            if loading and status == 200:
                await self.hold(adapter)  # loaded and registered here: Ray routes its requests here

        def _in_memory(self, adapter: str) -> bool:
            status = self.front.adapters.status().get(adapter)
            return bool(status and status.in_memory)

        def _cache_header(self, adapter: str, was_here: bool) -> list[tuple[bytes, bytes]]:
            """hit: its weights were here already; miss: read here for this request; none: not
            served (unknown, refused)."""
            if was_here:
                return [(CACHE_HEADER.encode(), b"hit")]
            if self._in_memory(adapter):
                self.misses.inc()
                return [(CACHE_HEADER.encode(), b"miss")]
            return []

        def release(self, name: str) -> None:
            """Called from any thread: unload `name` once no request holds it, unless it is held
            again meanwhile."""
            if self.loop is not None:
                self.loop.call_soon_threadsafe(self._release, name)

        def _release(self, name: str) -> None:
            """Unload now if no request holds it, else once they end (checked four times a second)."""
            if name in self.held:
                return
            try:
                self.front.adapters.unload(name)
                log.info("replica %s: unloaded adapter %r", self.replica, name)
            except UnknownAdapterError:
                pass
            except AdapterInUseError:
                self.loop.call_later(0.25, self._release, name)

        def _start_reporting(self) -> None:
            if self.reporter is None:
                self.loop = asyncio.get_running_loop()
                self.reporter = asyncio.ensure_future(self._report_forever())

        async def _report_forever(self) -> None:
            while True:
                with contextlib.suppress(Exception):  # the catalog restarting: try again next beat
                    await self._report()
                await asyncio.sleep(REPORT_INTERVAL_S)

        async def _report(self) -> None:
            metrics = self.server.metrics.render() + generate_latest(self.metrics)
            version, adapters = await self.catalog.report.remote(self.replica, self.version, metrics.decode())
            if adapters is not None:
                self.shared.update(adapters)  # before the version is acknowledged: gone names now 404 here
                shared = {a.name: a.content_hash for a in adapters}
                for info in self.front.adapters.list():
                    if shared.get(info.name) != info.content_hash:  # unloaded (or replaced) cluster-wide
                        self.held.discard(info.name)
                        self._release(info.name)
            self.version = version

        async def check_health(self) -> None:
            """Ray's health check; it also starts the heartbeat of a replica no request reached."""
            self._start_reporting()
            if not self.front.is_alive:
                raise RuntimeError("the engine failed; see the replica's log")

    return EngineReplica


class _LoadedAdapters:
    """`loraplex:adapter_loaded{lora_name}`: 1 per adapter registered on this replica."""

    def __init__(self, adapters) -> None:
        self.adapters = adapters

    def collect(self):
        family = GaugeMetricFamily("loraplex:adapter_loaded", "Adapters this replica holds.", labels=["lora_name"])
        for info in self.adapters.list():
            family.add_metric([info.name], 1)
        yield family


class _Held:
    """What the multiplexing LRU keeps per adapter; Ray calls `__del__` when it evicts it."""

    def __init__(self, replica, name: str) -> None:
        self.replica, self.name, self.released = replica, name, False

    def __del__(self) -> None:
        if not self.released:
            self.released = True
            self.replica.held.discard(self.name)
            self.replica.release(self.name)


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
    if not isinstance(name, str) or not name or name == base:
        return None
    return name[len(base) + 1:] if name.startswith(base + ":") else name


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
                      adapters: list[AdapterInfo], max_waiting_requests: int | None = None):
    """The Ray Serve application (`serve.run` it): catalog actor, engine replicas, ingress."""
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    catalog = ray.remote(num_cpus=0)(AdapterCatalog).remote(adapters)
    options: dict = {"ray_actor_options": {"num_cpus": cluster.replica_cpus},
                     "max_ongoing_requests": cluster.max_ongoing_requests, "health_check_period_s": 2,
                     "graceful_shutdown_timeout_s": cluster.shutdown_timeout_s}
    if cluster.max_replicas is not None and cluster.max_replicas > cluster.replicas:
        options["autoscaling_config"] = {"min_replicas": cluster.replicas, "max_replicas": cluster.max_replicas,
                                         "target_ongoing_requests": cluster.target_ongoing_requests}
    else:
        options["num_replicas"] = cluster.replicas
    if cluster.routing == "round-robin":
        options["request_router_config"] = RequestRouterConfig(
            request_router_class="ray.serve.experimental.round_robin_router:RoundRobinRouter")
    replica = serve.deployment(engine_replica(cluster.max_adapters_per_replica), name="Engine", **options)
    ingress = serve.deployment(Ingress, name="Ingress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024)
    engines = replica.bind(engine_args, model, server, catalog, int(cluster.replica_cpus), max_waiting_requests)
    return ingress.bind(engines, catalog, server.served_model_name, cluster.routing, server.max_request_body_bytes)


def described_adapters(lora_modules: list[tuple[str, str]], engine_args: dict, model: str) -> list[AdapterInfo]:
    """`--lora-modules` read once here (a bad folder fails start-up, as on one server), so the
    catalog lists each with its rank and targets before any replica reads it."""
    if not lora_modules:
        return []
    import torch

    from loraplex.adapters.registry import AdapterRegistry
    from loraplex.platform.config import ModelConfig

    registry = AdapterRegistry(ModelConfig.from_folder(model), 1, engine_args["max_lora_rank"], None,
                               torch.float32, lora_memory=0)
    return [registry.load(name, str(Path(path).resolve())) for name, path in lora_modules]


def serve_ray(args: argparse.Namespace) -> int:
    """`loraplex serve --ray`: a local Ray instance on loopback, or a running cluster
    (`--ray-address`), the application on it, until SIGTERM / SIGINT."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ValueError("--ray needs Ray Serve, the optional extra: pip install -e '.[ray]' (make setup-ray)") from None

    from loraplex.api.cli import engine_args
    from loraplex.api.serve import server_config
    from loraplex.platform.model_store import materialize_default_model

    logging.basicConfig(level=logging.INFO, format="[loraplex] %(message)s")
    cluster = ClusterConfig(replicas=args.replicas, max_replicas=args.max_replicas,
                            max_adapters_per_replica=args.max_adapters_per_replica, routing=args.ray_routing,
                            replica_cpus=args.replica_cpus, shutdown_timeout_s=args.shutdown_timeout)
    engine = engine_args(args)
    # replicas get None for the default model (each machine converts its own copy); checks here need a folder
    local_model = str(Path(args.model).resolve()) if args.model else None
    model_for_checks = local_model or str(materialize_default_model())
    server = server_config(args, model_for_checks)
    adapters = described_adapters(args.lora_modules, engine, model_for_checks)
    if args.ray_address:
        ray.init(address=args.ray_address, namespace="loraplex", log_to_driver=False)
    else:  # this machine only, everything on loopback
        ray.init(address="local", namespace="loraplex", include_dashboard=False, log_to_driver=False,
                 _node_ip_address="127.0.0.1", num_cpus=args.ray_num_cpus)
    serve.start(http_options={"host": args.host, "port": args.port})
    app = build_application(engine, local_model, server, cluster, adapters, args.max_waiting_requests)
    serve.run(app, name="loraplex", route_prefix="/", blocking=False)
    url = f"http://{args.host}:{args.port}"
    print(f"[loraplex] serving {server.served_model_name!r} at {url}/v1 on Ray Serve: {cluster.replicas} "
          f"replica(s), {cluster.routing} routing", file=sys.stderr, flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    with contextlib.suppress(Exception):
        serve.delete("loraplex")
        if not args.ray_address:
            serve.shutdown()
    ray.shutdown()
    return 0
