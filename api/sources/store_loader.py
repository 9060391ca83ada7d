"""Adapters from object storage as the adapter directory sees them (`adapter_directory.py`): the store made on
first need, which sources a caller resolves names in, where a loaded adapter came from and who may use it, the
fetch-and-load of a first use (one task per name, shared with the directory's other loads), a TTL's refresh, and
what the disk cache may evict (an idle loaded adapter is unloaded first)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from loraplex.api.sources.adapter_cache import AdapterCache, CacheEntry
from loraplex.api.sources.adapter_store import AdapterStore, Fetched
from loraplex.api.tenancy.callers import Caller
from loraplex.api.errors import APIError
from loraplex.api.sources.s3_source import StoreError
from loraplex.api.settings import ServerConfig
from loraplex.platform import model_store
from loraplex.platform.engine.engine_client import AdapterInfo, AdapterInUseError, EngineClient, UnknownAdapterError

log = logging.getLogger(__name__)


class StoreLoader:
    def __init__(self, client: EngineClient, config: ServerConfig, loading: dict[str, asyncio.Future],
                 on_store=None) -> None:
        """`loading`: the directory's loads in flight by name (one per name, whatever its kind); `on_store(store)`:
        told when the store is made (the metrics read its counts)."""
        self.client, self.config, self._loading, self._on_store = client, config, loading, on_store
        self._store: AdapterStore | None = None
        if config.adapter_sources:
            self.store  # the disk cache verified at start, a malformed source refused before serving

    def _loaded(self, name: str) -> AdapterInfo | None:
        return next((a for a in self.client.list_adapters() if a.name == name), None) if name else None

    def _here(self, name: str) -> bool:
        return self._loaded(name) is not None

    @property
    def store(self) -> AdapterStore:
        """Object storage (`--adapter-source`, tenants' `adapter_source`), made on first need."""
        if self._store is None:
            c = self.config
            folder = c.adapter_cache_dir or model_store.cache_dir() / "adapter-cache"
            self._store = AdapterStore(AdapterCache(folder, c.adapter_cache_size), c.adapter_sources,
                                       c.s3_endpoint_url, c.adapter_fetch_timeout, c.adapter_fetch_attempts,
                                       c.adapter_source_ttl)
            if self._on_store is not None:
                self._on_store(self._store)
        return self._store

    def sources_of(self, caller: Caller) -> tuple[str, ...]:
        """The object-storage sources `caller` resolves names in: a tenant's own, else the server's."""
        own = caller.tenant.adapter_source if caller.tenant is not None else None
        return (own,) if own else self.config.adapter_sources

    def origin(self, info: AdapterInfo) -> str | None:
        """The object-storage source a loaded adapter came from (its URL); None for one read from a folder."""
        if self._store is None or not info.path:
            return None
        entry = self._store.cache.entry_of(info.path)
        return entry.source if entry is not None else None

    def usable(self, info: AdapterInfo, caller: Caller) -> bool:
        """A tenant uses an adapter fetched from object storage only when it came from a source the tenant
        resolves names in: another tenant's bucket is not reachable by naming one of its adapters."""
        source = self.origin(info) if caller.tenant is not None else None
        return source is None or source in self.sources_of(caller)

    async def fetch_once(self, name: str, urls: tuple[str, ...], missing: str, param: str) -> None:
        """Adapter `name` fetched from `urls` and loaded, by one task however many requests ask at once."""
        load = self._loading.get(name)
        if load is None:
            load = asyncio.ensure_future(self._fetch_and_load(name, urls))
            self._loading[name] = load
            load.add_done_callback(lambda _: self._loading.pop(name, None))
        try:
            found = await asyncio.shield(load)
        except StoreError as exc:
            raise APIError(exc.status, f"The adapter `{name}` could not be fetched from its store: {exc.reason}.",
                           param) from None
        except ValueError as exc:
            if not self._here(name):
                raise APIError(400, f"adapter {name!r} could not be loaded: {exc}", param) from None
            return
        if not found and not self._here(name):  # (a TTL swap's task returns nothing: the new version is loaded)
            raise APIError(404, missing, param)

    async def _fetch_and_load(self, name: str, urls: tuple[str, ...]) -> bool:
        """True: fetched and loaded; False: no source holds it."""
        fetched = await asyncio.to_thread(self.store.fetch, name, urls, self._busy)
        if fetched is None:
            return False
        await self._load_fetched(name, fetched)
        return True

    async def _load_fetched(self, name: str, fetched: Fetched) -> None:
        """Loaded through the registry's checks; an adapter they refuse leaves the disk cache too (nothing
        refused stays to be served from it)."""
        log.info("loading adapter %r from %s (%s)", name, fetched.source,
                 "downloaded" if fetched.downloaded else "from the disk cache")
        try:
            await self.client.load_adapter(name, str(fetched.folder), True)
        except ValueError:
            self.store.cache.remove(fetched.folder)
            raise

    async def refresh(self, name: str) -> None:
        """A loaded adapter from object storage, past its TTL: listed again, and a new version (a changed ETag)
        loaded in its place once no request holds the old one; the request waits for that (one task per name,
        as for a first use). A store that cannot be read leaves the loaded version serving (logged)."""
        info = self._loaded(name)
        if self._store is None or info is None or name in self._loading or not self._store.due(Path(info.path)):
            return
        swap = asyncio.ensure_future(self._swap(name, Path(info.path)))
        self._loading[name] = swap
        swap.add_done_callback(lambda _: self._loading.pop(name, None))
        await asyncio.shield(swap)

    async def _swap(self, name: str, folder: Path) -> None:
        try:
            fetched = await asyncio.to_thread(self.store.current, name, folder, self._busy)
        except StoreError:
            return
        if fetched is None:
            return
        try:
            self.client.unload_adapter(name)
        except (AdapterInUseError, UnknownAdapterError):
            return  # the old version serves its requests; a request after the next TTL swaps it
        try:
            await self._load_fetched(name, fetched)
        except ValueError as exc:
            log.warning("adapter %r: its new version in %s was refused (%s); it is unknown until fixed",
                        name, fetched.source, exc)

    def _busy(self, entry: CacheEntry) -> bool:
        """Whether a cache entry must stay: the adapter loaded from it is in use. An idle one is unloaded from
        the engine first (its next request fetches it again)."""
        info = next((a for a in self.client.list_adapters() if a.path == str(entry.folder)), None)
        if info is None:
            return False
        try:
            self.client.unload_adapter(info.name)
        except AdapterInUseError:
            return True
        except UnknownAdapterError:
            pass
        return False
