"""loraplex on Ray Serve: several engine replicas behind one OpenAI endpoint, each adapter
placed on a replica by load and its requests routed to its holders with bounded load.

The parts, one module each:
- `api/cluster/ray_ingress.py`: `Ingress`, the HTTP entry; forwards each request to an engine replica
  with the adapter it is routed by, and answers the merged views.
- `api/cluster/ray_router.py`: `AdapterRouter`, the engine deployment's Ray request router (asks
  `api/cluster/placement.py`'s `Placement`), in the ingress's process; and the middleware of Ray's HTTP proxy.
- `api/cluster/ray_catalog.py`: `AdapterCatalog`, one Ray actor with the shared adapter names and the
  replicas' heartbeats.
- `api/cluster/ray_merge.py`: the replicas' metrics, stats, adapters and usage merged (pure functions).
- here: the engine replicas (`api/cluster/replica.py`'s `EngineReplica`, plain and tested without Ray, in
  a thin Ray deployment whose multiplexing hook is the replica's `hold`), the application built
  from the parts, and `loraplex serve --ray` running it until a stop signal (with one line on stdout
  once the cluster's `/ready` says so).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import signal
import threading
import urllib.request
from pathlib import Path
from typing import Callable

from loraplex.api import launch
from loraplex.api.flags import values
from loraplex.api.cluster.ray_catalog import AdapterCatalog
from loraplex.api.cluster.ray_ingress import Ingress
from loraplex.api.cluster.replica import EngineReplica
from loraplex.api.settings import ClusterConfig, ServerConfig
from loraplex.platform.engine.engine_client import AdapterInfo

__all__ = ["AdapterCatalog", "ClusterConfig", "Ingress", "build_application", "engine_replica", "serve_ray"]

log = logging.getLogger(__name__)

# Ray imports the router by this path in the ingress's process (the module imports Ray at its top),
# and its HTTP proxy the middlewares by the path in that variable
ROUTER = "loraplex.api.cluster.ray_router.AdapterRouter"
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_MIDDLEWARES = "loraplex.api.cluster.ray_router.proxy_middlewares"
READY_POLL_S = 0.5  # how often the command asks the cluster's /ready until it says so
READY_ASK_S = 10.0  # how long one such question may take (the ingress probes every replica)


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

        async def reached(self) -> str:
            return self.replica.reached()

    return RayEngineReplica


def start_replica(engine_args: dict, model: str | None, server: ServerConfig, catalog, torch_threads: int,
                  replica_id: str, routed) -> EngineReplica:
    """An engine on this machine (the default model converted here when none is given) and its
    replica."""
    import torch

    from loraplex.platform.config import EngineConfig
    from loraplex.platform.engine.engine_client import build_engine_client
    from loraplex.platform.model_store import materialize_default_model

    if torch_threads:
        torch.set_num_threads(torch_threads)
    model = model or str(materialize_default_model())  # each machine converts its own copy
    client = build_engine_client(EngineConfig(model=model, **engine_args), server.max_waiting_requests)
    return EngineReplica(client, server, catalog, replica_id, routed)


# ---- building and running it -----------------------------------------------------------------


def build_application(engine_args: dict, model: str | None, server: ServerConfig, cluster: ClusterConfig,
                      adapters: list[AdapterInfo]):
    """The Ray Serve application (`serve.run` it): catalog actor, engine replicas, ingress."""
    import ray
    from ray import serve

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # on this node: the usage ledger's file is where `--usage-db` (or the cache here) says
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    catalog = ray.remote(num_cpus=0, scheduling_strategy=here)(AdapterCatalog).remote(adapters, server.usage_db)
    # each replica enforces its share of every tenant's limits (docs/tenants.md)
    server = dataclasses.replace(server, tenant_limit_share=1.0 / cluster.replicas)
    ranks = engine_args.get("tensor_parallel_size", 1)
    gpus = ranks > 1 and _replica_on_gpus(engine_args.get("device", "auto"),
                                          lambda: ray.cluster_resources().get("GPU", 0))
    options = _replica_options(server, cluster, ranks, gpus)
    if "placement_group_bundles" in options:
        log.info("each replica reserves %s (%s) for its %d tensor-parallel ranks",
                 options["placement_group_bundles"], options["placement_group_strategy"], ranks)
    replica = serve.deployment(engine_replica(cluster.max_adapters_per_replica), name="Engine", **options)
    ingress = serve.deployment(Ingress, name="Ingress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024)
    engines = replica.bind(engine_args, model, server, catalog, int(cluster.replica_cpus))
    return ingress.bind(engines, catalog, server.served_model_name, cluster.routing, server.max_request_body_bytes,
                        cluster.replicas)


def _replica_options(server: ServerConfig, cluster: ClusterConfig, tensor_parallel_size: int = 1,
                     gpus: bool = False) -> dict:
    """The engine deployment's Ray options: resources, replica count or autoscaling, routing, and
    a tensor-parallel replica's placement group. Pure: Ray is imported only for a request router."""
    options: dict = {"ray_actor_options": {"num_cpus": cluster.replica_cpus},
                     "max_ongoing_requests": cluster.max_ongoing_requests, "health_check_period_s": 2,
                     "graceful_shutdown_timeout_s": server.shutdown_timeout_s}
    if cluster.max_replicas is not None and cluster.max_replicas > cluster.replicas:
        options["autoscaling_config"] = {"min_replicas": cluster.replicas, "max_replicas": cluster.max_replicas,
                                         "target_ongoing_requests": cluster.target_ongoing_requests}
    else:
        options["num_replicas"] = cluster.replicas
    router = _request_router(cluster)
    if router is not None:
        options["request_router_config"] = router
    options.update(_tensor_parallel_placement(cluster.replica_cpus, tensor_parallel_size, gpus))
    return options


def _request_router(cluster: ClusterConfig):
    """Ray's request router for the routing asked for; None: Ray's default (affinity)."""
    if cluster.routing == "round-robin":
        from ray.serve.config import RequestRouterConfig

        return RequestRouterConfig(request_router_class="ray.serve.experimental.round_robin_router:RoundRobinRouter")
    if cluster.routing == "adapter":
        from ray.serve.config import RequestRouterConfig

        return RequestRouterConfig(request_router_class=ROUTER, request_router_kwargs={"epsilon": cluster.load_epsilon})
    return None


def _replica_on_gpus(device: str, cluster_gpus) -> bool:
    """Whether a replica's engine runs on CUDA: `cuda` / `cuda:N` say so; `auto` does where the
    cluster has GPUs (`cluster_gpus()`, asked only then: it needs a running Ray)."""
    if device == "auto":
        return cluster_gpus() > 0
    return device.startswith("cuda")


def _tensor_parallel_placement(replica_cpus: float, size: int, gpus: bool) -> dict:
    """A tensor-parallel replica's extra Ray options: one placement group per replica, on one node
    (STRICT_PACK: the ranks talk over 127.0.0.1 / NVLink). Nothing for one rank.

    The ranks are the replica's child processes, not Ray actors: Ray only has to hold their
    resources, each rank the replica's CPUs. Ray places the replica actor in the first bundle and
    sets its CUDA_VISIBLE_DEVICES to the GPUs the actor itself holds, which the ranks inherit: so all
    N GPUs are the actor's, in the first bundle (GPUs in other bundles would be held but unseen)."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if size == 1:
        return {}
    actor = {"num_cpus": replica_cpus, **({"num_gpus": size} if gpus else {})}
    bundles = [{"CPU": replica_cpus, **({"GPU": size} if gpus else {})}] + [{"CPU": replica_cpus}] * (size - 1)
    # Ray refuses a bundle of zeros (replica_cpus 0): such a rank reserves nothing
    bundles = [kept for kept in ({k: v for k, v in b.items() if v > 0} for b in bundles) if kept]
    if not bundles:  # nothing to hold: the ranks run beside the replica all the same
        return {"ray_actor_options": actor}
    return {"ray_actor_options": actor, "placement_group_bundles": bundles, "placement_group_strategy": "STRICT_PACK"}


def described_adapters(lora_modules: list[tuple[str, str]], engine_args: dict, model: str) -> list[AdapterInfo]:
    """`--lora-modules` read once here (a bad folder fails start-up, as on one server), so the
    catalog lists each with its rank and targets before any replica reads it."""
    from loraplex.platform.engine.engine_client import read_adapter_info

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

    engine = launch.engine_args(args)
    # replicas get None for the default model (each machine converts its own copy); checks here need a folder
    local_model = launch.model_folder(args.model) if args.model else None
    model_for_checks = local_model or launch.model_folder(None)
    server = launch.server_config(args, model_for_checks)
    adapters = described_adapters(args.lora_modules, engine, model_for_checks)
    _start_ray(cluster)
    serve.start(http_options={"host": server.host, "port": server.port})
    serve.run(build_application(engine, local_model, server, cluster, adapters), name="loraplex", route_prefix="/",
              blocking=False)
    log.info("serving %r at %s/v1 on Ray Serve: %d replica(s), %s routing", server.served_model_name, server.url,
             cluster.replicas, cluster.routing)
    _wait_for_a_stop_signal(lambda: _is_ready(server), lambda: _say_ready(server, cluster))
    with contextlib.suppress(Exception):
        serve.delete("loraplex")
        if not cluster.address:
            serve.shutdown()
    ray.shutdown()
    return 0


def _start_ray(cluster: ClusterConfig) -> None:
    import ray

    # Ray's proxy reads its middlewares' import path from its environment, inherited from here by a
    # local Ray; a running cluster's is the one `ray start` had (docs/ray.md)
    os.environ.setdefault(PROXY_CALLBACK_ENV, PROXY_MIDDLEWARES)
    if cluster.address:
        ray.init(address=cluster.address, namespace="loraplex", log_to_driver=False)
    else:  # this machine only, everything on loopback
        ray.init(address="local", namespace="loraplex", include_dashboard=False, log_to_driver=False,
                 _node_ip_address="127.0.0.1", num_cpus=cluster.num_cpus)


def _wait_for_a_stop_signal(ready: Callable[[], bool], when_ready: Callable[[], None]) -> None:
    """Until SIGTERM / SIGINT; meanwhile `ready` is asked until it says so, then `when_ready` runs once."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(READY_POLL_S):
        if ready():
            when_ready()
            break
    stop.wait()


def _is_ready(server: ServerConfig) -> bool:
    """The cluster's own `/ready` (the ingress asks its router and the catalog): the line printed
    then means what a load balancer is told."""
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through an HTTP_PROXY
    try:
        with direct.open(_local_url(server) + "/ready", timeout=READY_ASK_S) as reply:
            return reply.status == 200
    except OSError:  # not up yet (the proxy, the ingress), or 503: not ready
        return False


def _local_url(server: ServerConfig) -> str:
    """Where this machine reaches the proxy: loopback when it listens on every interface."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(server.host, server.host)
    return f"http://[{host}]:{server.port}" if ":" in host else f"http://{host}:{server.port}"


def _say_ready(server: ServerConfig, cluster: ClusterConfig) -> None:
    line = f"loraplex: ready at {server.url}/v1 ({cluster.replicas} replica{'s' if cluster.replicas != 1 else ''})"
    log.info("%s", line)
    print(line, flush=True)  # the command's output: what a script starting it waits for
