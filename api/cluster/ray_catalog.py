"""`AdapterCatalog`: the cluster's shared adapter names and the replicas' heartbeats, run as one
async Ray actor (`api/cluster/ray_serve.py` starts it). A plain class: tested without Ray.

Replicas report to it twice a second (their metrics, stats, adapters and usage, the catalog version
they applied) and let go of names it no longer has, so an unload reaches every replica; the unload
answers once every live replica has seen it. The ingress reads the live replicas' reports back to
merge them (`api/cluster/ray_merge.py`)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from loraplex.platform.engine.engine_client import AdapterInfo

REPLICA_SILENT_S = 10.0  # a replica not heard from for this long is gone (no longer waited for or listed)


@dataclass
class _Report:
    seen: float
    version: int
    metrics: str
    view: dict | None = None  # the replica's stats and adapters (`EngineReplica.view`)


class AdapterCatalog:
    """Adapter name -> where it is read from (an `AdapterInfo`), for every replica."""

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
