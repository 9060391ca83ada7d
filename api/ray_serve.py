"""loraplex on Ray Serve: several engine replicas behind one OpenAI endpoint, each adapter
placed on a replica by load and its requests routed to its holders with bounded load.

Three parts:
- `Ingress`: the HTTP entry. It reads which adapter a request names (`model`, the heaviest of
  an `adapters` mix, or `lora_name` for an admin load) and forwards the request as it came,
  with that adapter as the multiplexed model id, to an engine replica; the reply streams back
  as the replica wrote it. Which replica: Ray Serve's request router for the engine deployment,
  in the ingress's process; ours (`adapter_router`) asks `api/placement.py`'s `Placement`, with
  the adapters each replica holds as Ray's multiplexing reports them. `/metrics` is every
  replica's, with a `replica` label; `/v1/stats` and `/v1/adapters` are merged over replicas
  (each adapter with the replicas holding it).
- The engine replicas: `api/replica.py`'s `EngineReplica` (plain, tested without Ray) in a thin
  Ray deployment (`engine_replica`) whose multiplexing hook is the replica's `hold`.
- `AdapterCatalog`: one Ray actor with the shared adapter names (`SharedAdapters` for the app).
  Replicas report to it twice a second (their metrics, stats and adapters, the catalog version
  they applied) and let go of names it no longer has, so an unload reaches every replica; the
  unload answers once every live replica has seen it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
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
from loraplex.api.placement import LOAD_EPSILON, Placement, request_tokens
from loraplex.api.replica import EngineReplica
from loraplex.api.settings import ClusterConfig, ServerConfig
from loraplex.platform.engine_client import AdapterInfo

__all__ = ["AdapterCatalog", "ClusterConfig", "Ingress", "adapter_named", "adapter_router", "build_application",
           "call_asgi", "engine_replica", "merge_adapters", "merge_metrics", "merge_stats", "scoped_stats", "serve_ray",
           "tenant_adapters"]

log = logging.getLogger(__name__)

REPLICA_SILENT_S = 10.0  # a replica not heard from for this long is gone (no longer waited for or listed)


# ---- the shared adapter names ------------------------------------------------------------------


@dataclass
class _Report:
    seen: float
    version: int
    metrics: str
    view: dict | None = None  # the replica's stats and adapters (`EngineReplica.view`)


class AdapterCatalog:
    """Adapter name -> where it is read from (an `AdapterInfo`), for every replica. Run as one
    async Ray actor."""

    def __init__(self, adapters: list[AdapterInfo]) -> None:
        self.adapters = {a.name: a for a in adapters}
        self.tenants_version = 0  # bumped by each tenants reload, applied by every replica
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

    async def report(self, replica: str, version: int, metrics: str,
                     view: dict | None = None) -> tuple[int, list[AdapterInfo] | None]:
        """A replica's heartbeat: its metrics (and stats and adapters) and the version it applied.
        Back: the current version, and the names when they changed since."""
        self.replicas[replica] = _Report(time.monotonic(), version, metrics, view)
        return self.version, (list(self.adapters.values()) if version != self.version else None)

    async def metrics(self) -> dict[str, str]:
        return {name: r.metrics for name, r in self._live().items()}

    async def tenants_reloaded(self) -> int:
        """One replica re-read the tenants file (POST /v1/reload_tenants): the others do on their next
        heartbeat, seeing the new version."""
        self.tenants_version += 1
        return self.tenants_version

    async def tenants(self) -> int:
        return self.tenants_version

    async def views(self) -> dict[str, dict]:
        return {name: r.view for name, r in self._live().items() if r.view is not None}

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


def merge_stats(by_replica: dict[str, dict]) -> dict:
    """Each replica's `/v1/stats` as one: counts summed, usage averaged, adapter lists joined,
    latency percentiles the worst replica's, each tenant's own numbers (`tenants`) merged alike;
    each replica's own under `replicas`."""
    stats = [s for _, s in sorted(by_replica.items())]
    if not stats:
        return {"replicas": {}}
    return {**_merged(stats), "replicas": dict(sorted(by_replica.items()))}


def _merged(stats: list[dict]) -> dict:
    merged: dict = {}
    for key in dict.fromkeys(key for s in stats for key in s):
        values = [s[key] for s in stats if key in s]
        first = values[0]
        if key == "time":
            merged[key] = max(values)
        elif key == "tenants":
            merged[key] = {name: _merged([v[name] for v in values if name in v])
                           for name in sorted({name for v in values for name in v})}
        elif key == "served":
            merged[key] = _summed_counts(values)
        elif key.endswith("_perc"):
            merged[key] = sum(values) / len(values)
        elif isinstance(first, (int, float)) and not isinstance(first, bool):
            merged[key] = sum(values)
        elif isinstance(first, list):
            merged[key] = list(dict.fromkeys(v for value in values for v in value))
        elif isinstance(first, dict):
            merged[key] = _worst_percentiles(values)
        else:
            merged[key] = first
    return merged


def _summed_counts(values: list[dict[str, dict[str, int]]]) -> dict[str, dict[str, int]]:
    """Counts per name (an adapter's traffic), added up."""
    out: dict[str, dict[str, int]] = {}
    for value in values:
        for name, counts in value.items():
            into = out.setdefault(name, {})
            for key, count in counts.items():
                into[key] = into.get(key, 0) + count
    return out


def scoped_stats(merged: dict, reply: dict) -> dict:
    """The merged stats as the caller may read them. A tenant (the replica's reply names it) reads its
    own numbers added up over the replicas, nothing of the engines' (docs/tenants.md); any other caller
    the engines', without each tenant's own."""
    tenant = reply.get("tenant")
    if tenant is None and "adapter_scope" not in reply:
        replicas = {name: _without_tenants(s) for name, s in merged.get("replicas", {}).items()}
        return {**_without_tenants(merged), **({"replicas": replicas} if "replicas" in merged else {})}
    own = merged.get("tenants", {}).get(tenant) if tenant is not None else None
    if own is None:  # no heartbeat carries its numbers yet: the replica's own answer
        return reply
    return {**{k: v for k, v in own.items() if k != "served"}, "tenant": tenant,
            "adapter_scope": reply.get("adapter_scope", [])}


def _without_tenants(stats: dict) -> dict:
    return {k: v for k, v in stats.items() if k != "tenants"}


def tenant_adapters(reply: dict, served: list[dict[str, dict[str, int]]]) -> dict:
    """A tenant's `/v1/adapters` (its replica's reply) with its own traffic on each adapter and the base
    model added up over the replicas (`served`: each replica's, from its stats); nothing of where an
    adapter is."""
    summed = _summed_counts(served)
    rows = [{**row, **fmt.adapter_traffic(summed.get(row["id"], {}))} for row in reply.get("data", [])]
    return {**reply, "data": rows, "base": fmt.adapter_traffic(summed.get("", {}))}


def merge_usage(usages: list[dict]) -> dict:
    """Each replica's `/v1/usage` added up: per tenant and per adapter, every count summed."""
    merged: dict = {"tenants": {}, "adapters": {}, "totals": {}}
    for usage in usages:
        for group in ("tenants", "adapters"):
            for name, counts in usage.get(group, {}).items():
                into = merged[group].setdefault(name, {})
                for key, value in counts.items():
                    into[key] = into.get(key, 0) + value
        for key, value in usage.get("totals", {}).items():
            merged["totals"][key] = merged["totals"].get(key, 0) + value
    return merged


def _worst_percentiles(values: list[dict]) -> dict:
    out = {}
    for key in values[0]:
        present = [v[key] for v in values if v.get(key) is not None]
        out[key] = (sum(present) if key == "count" else max(present)) if present else None
    return out


def merge_adapters(reply: dict, by_replica: dict[str, list[dict]]) -> dict:
    """A replica's `/v1/adapters` (every shared name) with each adapter's residency and traffic
    summed over the replicas, and `replicas`: those holding it."""
    rows_of = {replica: {row["id"]: row for row in rows} for replica, rows in by_replica.items()}
    data = []
    for row in reply.get("data", []):
        here = {replica: rows[row["id"]] for replica, rows in sorted(rows_of.items()) if row["id"] in rows}
        rows = here.values()
        data.append({**row, "replicas": list(here), "in_memory": any(r.get("in_memory") for r in rows),
                     "resident": any(r.get("resident") for r in rows), "pinned": sum(r.get("pinned", 0) for r in rows),
                     "requests": sum(r.get("requests", 0) for r in rows),
                     "generation_tokens": sum(r.get("generation_tokens", 0) for r in rows)})
    return {**reply, "data": data}


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


# ---- which replica ----------------------------------------------------------------------------


def adapter_router():
    """The engine deployment's Ray request router: `Placement` decides. It runs in the ingress's
    process, the engine replicas' only caller, so the loads it counts are the cluster's."""
    from ray.serve.request_router import RequestRouter

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
            body = pending_request.args[1] if len(pending_request.args) > 1 else b""
            order = self.placement.choose(meta.internal_request_id, meta.multiplexed_model_id or None,
                                          request_tokens(body if isinstance(body, bytes) else b""))
            return [[by_id[r]] for r in order if r in by_id]

        def on_request_routed(self, pending_request, replica_id, result) -> None:
            meta = pending_request.metadata
            self.placement.dispatched(meta.internal_request_id, replica_id.unique_id,
                                      meta.multiplexed_model_id or None)

        def on_request_completed(self, replica_id, internal_request_id: str) -> None:
            self.placement.finished(internal_request_id, replica_id.unique_id)

    AdapterRouter.__qualname__ = "AdapterRouter"
    return AdapterRouter


def __getattr__(name: str):
    """`AdapterRouter`, made on first use: Ray imports a router by its module and name, and Ray
    is an optional extra this module does not import at the top."""
    if name != "AdapterRouter":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = adapter_router()
    return globals()[name]


# ---- the ingress -----------------------------------------------------------------------------


def adapter_named(method: str, path: str, body: bytes, base: str) -> str | None:
    """The adapter a request is routed by: `model` of a generation request (`base:name` or
    `name`), or the heaviest adapter of its `adapters` mix (largest |weight|, the first listed
    of equals); `lora_name` of an admin load; None for the base model and everything else."""
    if method != "POST" or path not in ("/v1/chat/completions", "/v1/completions", "/v1/load_lora_adapter"):
        return None
    try:
        fields = json.loads(body)
        if path.endswith("load_lora_adapter"):
            name = fields.get("lora_name")
        elif fields.get("adapters") is not None:  # a mix: `model` names the base
            name = _heaviest(fields["adapters"])
        else:
            name = fields.get("model")
    except (ValueError, AttributeError):  # the app answers malformed bodies itself
        return None
    if not isinstance(name, str):
        return None
    return adapter_of(name, base) or None


def _heaviest(mix) -> str | None:
    """The name of a mix's heaviest adapter; None when `mix` is not a well-formed list of
    {"name", "weight"} (routed as the base model, and the replica's app answers the 400)."""
    if not isinstance(mix, list) or not mix:
        return None
    best, best_weight = None, -1.0
    for entry in mix:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            return None
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight != weight:
            return None
        if abs(weight) > best_weight:
            best, best_weight = entry["name"], abs(weight)
    return best


MERGED_VIEWS = ("/v1/adapters", "/v1/stats", "/v1/usage", "/metrics")  # from every replica's heartbeat


class Ingress:
    def __init__(self, engines, catalog, base: str, routing: str, max_body: int) -> None:
        self.engines, self.catalog = engines, catalog
        self.base, self.routing, self.max_body = base, routing, max_body

    async def __call__(self, request):
        from starlette.responses import Response, StreamingResponse

        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body:
                message = f"request body larger than {self.max_body} bytes (max_request_body_bytes)"
                return Response(json.dumps(fmt.error_body(413, message)), 413, media_type="application/json")
        adapter = adapter_named(request.method, request.url.path, bytes(body), self.base)
        handle = self.engines.options(stream=True, multiplexed_model_id=(adapter or "") if self.routing != "round-robin"
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

        if request.method == "GET" and request.url.path in MERGED_VIEWS and start["status"] == 200:
            reply = b"".join([chunk async for chunk in replies])  # the caller is allowed (the replica said): merge
            if request.url.path == "/metrics":
                return Response(merge_metrics(await self.catalog.metrics.remote()),
                                media_type="text/plain; version=0.0.4; charset=utf-8")
            return Response(json.dumps(await self._merged(request.url.path, json.loads(reply))), 200,
                            media_type="application/json")
        if request.url.path == "/v1/reload_tenants" and start["status"] == 200:
            await self.catalog.tenants_reloaded.remote()  # the other replicas follow on their heartbeat
        response = StreamingResponse(rest(), status_code=start["status"])
        response.raw_headers = [(k, v) for k, v in start["headers"]]
        return response

    async def _merged(self, path: str, reply: dict) -> dict:
        views = await self.catalog.views.remote()
        if not views:  # no heartbeat yet: the one replica's answer
            return reply
        if path == "/v1/stats":
            return scoped_stats(merge_stats({replica: view["stats"] for replica, view in views.items()}), reply)
        if path == "/v1/usage":
            return merge_usage([view["usage"] for view in views.values() if "usage" in view])
        tenant = reply.get("tenant")
        if tenant is not None:
            return tenant_adapters(reply, [view.get("stats", {}).get("tenants", {}).get(tenant, {}).get("served", {})
                                           for view in views.values()])
        return merge_adapters(reply, {replica: view["adapters"] for replica, view in views.items()})


# ---- building and running it -----------------------------------------------------------------


def build_application(engine_args: dict, model: str | None, server: ServerConfig, cluster: ClusterConfig,
                      adapters: list[AdapterInfo]):
    """The Ray Serve application (`serve.run` it): catalog actor, engine replicas, ingress."""
    import ray
    from ray import serve

    catalog = ray.remote(num_cpus=0)(AdapterCatalog).remote(adapters)
    # each replica enforces its share of every tenant's limits (docs/tenants.md)
    server = dataclasses.replace(server, tenant_limit_share=1.0 / cluster.replicas)
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
    elif cluster.routing == "adapter":
        options["request_router_config"] = RequestRouterConfig(request_router_class=f"{__name__}.AdapterRouter",
                                                               request_router_kwargs={"epsilon": cluster.load_epsilon})
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
