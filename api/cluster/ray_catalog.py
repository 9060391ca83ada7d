"""`AdapterCatalog`: the cluster's shared adapter names and the replicas' heartbeats, run as one
async Ray actor (`api/cluster/ray_serve.py` starts it). A plain class: tested without Ray.

Replicas report to it twice a second (their metrics, stats and adapters, the catalog version
they applied) and let go of names it no longer has, so an unload reaches every replica; the unload
answers once every live replica has seen it. It keeps the cluster's one usage ledger: replicas send
it their rows and a request's answer waits for their commit, as on one server. The ingress reads
the live replicas' reports back to merge them (`api/cluster/ray_merge.py`), and asks it whether the
cluster is ready (`readiness`: the replicas its router reached that last reported themselves
ready)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from loraplex.api.admin.ledger import UsageLedger, UsageRow
from loraplex.platform.engine.engine_client import AdapterInfo

REPLICA_SILENT_S = 10.0  # a replica not heard from for this long is gone (no longer waited for or listed)


@dataclass
class _Report:
    seen: float
    version: int
    metrics: str
    view: dict | None = None  # the replica's stats and adapters (`EngineReplica.view`)


@dataclass
class Readiness:
    """The cluster's `/ready`: how many engine replicas are ready of the number the deployment wants."""

    ready: bool
    replicas_ready: int
    replicas_wanted: int

    @property
    def message(self) -> str:
        return f"{self.replicas_ready} of {self.replicas_wanted} engine replicas ready"


def cluster_readiness(views: dict[str, dict], reached: list[str], wanted: int, was_ready: bool) -> Readiness:
    """Ready replicas: those the ingress's router reached (so requests and placement can go there) whose
    last live report says ready (`EngineReplica.view`). The cluster is ready once all `wanted` are;
    after that, while any one is (a replica Ray is replacing does not take the survivors out of a
    load balancer's rotation: `/ready` says how many)."""
    ready = sum(1 for replica in set(reached) if (views.get(replica) or {}).get("ready"))
    return Readiness(ready >= wanted or (was_ready and ready > 0), ready, wanted)


class AdapterCatalog:
    """Adapter name -> where it is read from (an `AdapterInfo`), for every replica."""

    def __init__(self, adapters: list[AdapterInfo], usage_db: str | None = None) -> None:
        """`usage_db`: the cluster's usage ledger file (None: in memory), written here alone."""
        self.adapters = {a.name: a for a in adapters}
        self.ledger = UsageLedger(usage_db)
        self.tenants_version = 0  # bumped by each tenants reload, applied by every replica
        self.version = 0
        self.replicas: dict[str, _Report] = {}
        self.was_ready = False  # the cluster had every replica it wants ready once (kept here: an ingress may restart)

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

    async def bill(self, rows: list[UsageRow]) -> None:
        """A replica's usage rows, answered once committed (a row sent twice is billed once)."""
        self.ledger.record_many(rows)
        await self.ledger.committed()

    async def usage(self, since: float | None, until: float | None) -> dict:
        """`GET /v1/usage` of the cluster: the ledger in a window."""
        return await asyncio.to_thread(self.ledger.usage, since, until)

    async def views(self) -> dict[str, dict]:
        return {name: r.view for name, r in self._live().items() if r.view is not None}

    async def readiness(self, reached: list[str], wanted: int) -> Readiness:
        """`cluster_readiness` over the live reports; `reached`: the replicas the ingress's router reached."""
        readiness = cluster_readiness(await self.views(), reached, wanted, self.was_ready)
        self.was_ready = self.was_ready or readiness.replicas_ready >= wanted
        return readiness

    def _live(self) -> dict[str, _Report]:
        now = time.monotonic()
        return {name: r for name, r in self.replicas.items() if now - r.seen < REPLICA_SILENT_S}
