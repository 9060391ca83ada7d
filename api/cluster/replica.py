"""One engine replica of a Ray Serve cluster, without Ray: the same app as `loraplex serve`
(`app_for`: same routes, validation, auth, errors, SSE) called in-process, over an engine
client and the shared adapter catalog. `api/cluster/ray_serve.py` wraps it in a Ray deployment whose
multiplexing hook is `hold`.

`hold` reads an adapter on first use (the app's own first-use load, so confinement and errors
are the server's); what it returns is what Ray's LRU keeps, and its eviction unloads the adapter
once its requests end. Replies carry `x-loraplex-replica` and, for adapter requests,
`x-loraplex-adapter-cache: hit|miss` (miss: its weights had to be read here). Twice a second
the replica reports to the catalog (its metrics, stats and adapters, whether it is ready, the
catalog version it applied) and lets go of names the catalog no longer has.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, AsyncIterator, Callable

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily

from loraplex.api.admin.ledger import RemoteLedger, UsageRow
from loraplex.api.tenancy import auth
from loraplex.api.openai import openai_format as fmt
from loraplex.api.cluster.in_process import call_asgi
from loraplex.api.admin.routes_tenants import reload_tenants_now
from loraplex.api.server import app_for
from loraplex.api.settings import ServerConfig
from loraplex.api.state import ServerState
from loraplex.api.tenancy.tenants import TenantsError
from loraplex.platform.engine.engine_client import (AdapterInfo, AdapterInUseError, EngineClient, UnknownAdapterError)

log = logging.getLogger(__name__)

REPLICA_HEADER = "x-loraplex-replica"
CACHE_HEADER = "x-loraplex-adapter-cache"
REPORT_INTERVAL_S = 0.5
RELEASE_RETRY_S = 0.25  # an evicted adapter still in use is unloaded when its requests end
LEDGER_CALL_S = 10.0  # a call to the cluster's ledger that takes longer failed (its rows are sent again)


class CatalogClient:
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


class EngineReplica:
    def __init__(self, client: EngineClient, config: ServerConfig, catalog, replica_id: str,
                 routed: Callable[[], bool] = lambda: True) -> None:
        """`routed`: whether Ray routed this request by its adapter (a multiplexed model id)."""
        self.client, self.catalog, self.replica, self.routed = client, catalog, replica_id, routed
        self.shared = CatalogClient(catalog)
        self.state = ServerState.create(client, config, self.shared, RemoteLedger(self._bill, self._usage))
        self.app = app_for(self.state)
        self.hook = self.hold  # Ray's wrapper puts its multiplexed method here
        self.id_header = (REPLICA_HEADER.encode(), replica_id.encode())
        self.held: set[str] = set()  # names Ray's multiplexing LRU holds here
        self.metrics = CollectorRegistry(auto_describe=False)
        self.metrics.register(_LoadedAdapters(client))
        self.misses = Counter("loraplex:adapter_cache_misses", "Adapter requests whose weights this replica "
                              "had to read first.", registry=self.metrics)
        self.version = -1
        self.tenants_version: int | None = None  # the catalog's tenants version this replica applied
        self.loop: asyncio.AbstractEventLoop | None = None
        self.reporter: asyncio.Task | None = None

    async def hold(self, name: str) -> "_Held":
        """Read the adapter here, and tell Ray (through what it keeps) this replica has it."""
        await self.state.adapters.resolve(name)
        self.held.add(name)
        return _Held(self, name)

    async def forward(self, request: dict, body: bytes, adapter: str | None) -> AsyncIterator[Any]:
        """The app's reply to one request: {"status", "headers"}, then the body's chunks."""
        self._start_reporting()
        loading = request["path"] == "/v1/load_lora_adapter"
        # nothing is read for, or said about, an adapter the request's key may not use: an unknown key
        # or another tenant's adapter name learns and costs nothing here
        adapter = adapter if adapter is not None and self._allowed(request, adapter) else None
        was_here = adapter is not None and self._in_memory(adapter)
        if adapter is not None and not loading and self.routed():
            with contextlib.suppress(Exception):  # unknown or bad: the app answers the request with it
                await self.hook(adapter)
        status = None
        async for message in call_asgi(self.app, request, body, [self.id_header]):
            if isinstance(message, dict):
                status = message["status"]
                if adapter is not None and not loading and status < 300:  # resolved (read) by now
                    message["headers"].extend(self._cache_header(adapter, was_here))
            yield message
        if loading and status == 200:
            await self.hook(adapter)  # loaded and registered here: Ray routes its requests here

    def _bill(self, rows: list[UsageRow]) -> None:
        """The ledger's writer thread: `rows` committed to the cluster's ledger (the catalog's)."""
        self._on_loop(self.catalog.bill, rows)

    def _usage(self, since: float | None, until: float | None) -> dict:
        """`GET /v1/usage` (from a worker thread): the cluster's ledger, summed."""
        return self._on_loop(self.catalog.usage, since, until)

    def _on_loop(self, method, *args):
        """Call an actor method from another thread, on this replica's event loop (where its handle lives)."""
        if self.loop is None:
            raise RuntimeError("the replica has not started serving")

        async def call():
            return await method.remote(*args)

        future = asyncio.run_coroutine_threadsafe(call(), self.loop)
        try:
            return future.result(LEDGER_CALL_S)
        except BaseException:
            future.cancel()  # not left running on the loop
            raise

    def _allowed(self, request: dict, adapter: str) -> bool:
        authorization = next((v.decode("latin-1") for k, v in request["headers"] if k.lower() == b"authorization"), "")
        return auth.may_use(self.state, auth.bearer(authorization), adapter)

    def _in_memory(self, adapter: str) -> bool:
        status = self.client.adapter_status().get(adapter)
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
        if name in self.held:
            return
        try:
            self.client.unload_adapter(name)
            log.info("replica %s: unloaded adapter %r", self.replica, name)
        except UnknownAdapterError:
            pass
        except AdapterInUseError:
            self.loop.call_later(RELEASE_RETRY_S, self._release, name)

    def _start_reporting(self) -> None:
        if self.reporter is None:
            self.loop = asyncio.get_running_loop()
            self.reporter = asyncio.ensure_future(self._report_forever())

    async def _report_forever(self) -> None:
        while True:
            with contextlib.suppress(Exception):  # the catalog restarting: try again next beat
                await self.report()
            await asyncio.sleep(REPORT_INTERVAL_S)

    async def report(self) -> None:
        """One heartbeat: metrics, stats and adapters out; back, the catalog's names when they
        changed."""
        metrics = self.state.metrics.render() + generate_latest(self.metrics)
        version, adapters = await self.catalog.report.remote(self.replica, self.version, metrics.decode(),
                                                             self.view())
        if adapters is not None:
            self.shared.update(adapters)  # before the version is acknowledged: gone names now 404 here
            self._let_go_of_unshared(adapters)
        self.version = version
        if self.state.tenants.enabled:
            await self._follow_tenant_reloads()

    async def _follow_tenant_reloads(self) -> None:
        """Another replica re-read the tenants file (the catalog's version moved): this one does too."""
        seen = await self.catalog.tenants.remote()
        if self.tenants_version is not None and seen != self.tenants_version:
            with contextlib.suppress(TenantsError):  # logged and audited; the old tenants stay
                reload_tenants_now(self.state, "cluster")
        self.tenants_version = seen

    def view(self) -> dict:
        """What the ingress merges: this replica's `/v1/stats` and its `/v1/adapters` rows (the
        adapters registered here); and whether it is ready (the cluster's `/ready` counts it)."""
        rows = fmt.adapter_list(self.client.list_adapters(), self.client.adapter_status(),
                                self.state.metrics.by_adapter)["data"]
        return {"stats": self.state.metrics.snapshot(), "adapters": rows, "ready": self.ready()}

    def ready(self) -> bool:
        """What one server's `/ready` checks: the engine takes requests and nothing is still starting
        (its grammar compile workers). Its `--lora-modules` are the catalog's, read on first use."""
        health = self.client.health()
        return health.problem is None and health.warming is None

    def reached(self) -> str:
        """The ingress's probe through its router (`/ready`); it starts the heartbeat too."""
        self._start_reporting()
        return self.replica

    def _let_go_of_unshared(self, adapters: list[AdapterInfo]) -> None:
        shared = {a.name: a.content_hash for a in adapters}
        for info in self.client.list_adapters():
            if shared.get(info.name) != info.content_hash:  # unloaded (or replaced) cluster-wide
                self.held.discard(info.name)
                self._release(info.name)

    async def check_health(self) -> None:
        """Ray's health check; it also starts the heartbeat of a replica no request reached."""
        self._start_reporting()
        if not self.client.health().alive:
            raise RuntimeError("the engine failed; see the replica's log")

    def close(self) -> None:
        self.client.shutdown()
        self.state.tracing.shutdown()  # a replica's app has no lifespan: its buffered spans are exported here


class _LoadedAdapters:
    """`loraplex:adapter_loaded{lora_name}`: 1 per adapter registered on this replica."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client

    def collect(self):
        family = GaugeMetricFamily("loraplex:adapter_loaded", "Adapters this replica holds.", labels=["lora_name"])
        for info in self.client.list_adapters():
            family.add_metric([info.name], 1)
        yield family


class _Held:
    """What the multiplexing LRU keeps per adapter; Ray calls `__del__` when it evicts it."""

    def __init__(self, replica: EngineReplica, name: str) -> None:
        self.replica, self.name, self.released = replica, name, False

    def __del__(self) -> None:
        if not self.released:
            self.released = True
            self.replica.held.discard(self.name)
            self.replica.release(self.name)
