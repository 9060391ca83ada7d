"""Adapters fetched from object storage on first use (`--adapter-source s3://bucket/prefix`, a tenant's
`adapter_source`), through the disk cache (`adapter_cache.py`).

`fetch` lists the adapter in each source in turn (the first that holds it wins), then serves the cached version if
the listing matches one, else downloads it: one download per version at a time (single flight: concurrent first
requests wait for the one in progress), into a staging folder, verified, renamed into place. Every call blocks:
the server runs it in a worker thread, before the request reaches the engine (no seat is held while it waits).
`stale` says when a loaded adapter's source is due to be listed again (`--adapter-source-ttl`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from loraplex.api.sources.adapter_cache import AdapterCache, CacheEntry
from loraplex.api.sources.s3_source import S3Source, StoreError, StoredObject, valid_name

log = logging.getLogger(__name__)
COUNTS = ("cache_hits", "cache_misses", "downloads", "download_bytes", "fetch_failures", "evictions")


@dataclass(frozen=True)
class Fetched:
    folder: Path  # the cached adapter, ready to load
    source: str  # the source's URL it came from
    downloaded: bool
    evicted: tuple[CacheEntry, ...] = ()  # cache entries the download pushed out


class AdapterStore:
    def __init__(self, cache: AdapterCache, urls: tuple[str, ...], endpoint_url: str | None = None,
                 timeout_s: float = 30.0, max_attempts: int = 3, ttl_s: float = 300.0) -> None:
        for url in urls:
            S3Source(url, endpoint_url)  # a malformed URL fails at start, not at the first request
        self.cache, self.urls, self.endpoint_url = cache, urls, endpoint_url
        self.timeout_s, self.max_attempts, self.ttl_s = timeout_s, max_attempts, ttl_s
        self.counts: Counter[str] = Counter()
        self._sources: dict[str, S3Source] = {}
        self._lock = threading.Lock()
        self._flights: dict[Path, threading.Lock] = {}  # version folder -> the lock its one download holds
        self._listed: dict[str, float] = {}  # version folder -> when its source last listed it (monotonic)

    def source(self, url: str) -> S3Source:
        with self._lock:
            if url not in self._sources:
                self._sources[url] = S3Source(url, self.endpoint_url, self.timeout_s, self.max_attempts)
            return self._sources[url]

    def fetch(self, name: str, urls: tuple[str, ...], busy: Callable[[CacheEntry], bool]) -> Fetched | None:
        """Adapter `name` from the first of `urls` that holds it, cached; None when none does. A StoreError
        (logged here with what it was) when a source cannot be read or the download fails."""
        if not valid_name(name):
            return None
        for url in urls:
            source = self.source(url)
            try:
                objects = source.listing(name)
                if objects is not None:
                    return self._cached(source, name, objects, busy)
            except StoreError as exc:
                self.counts["fetch_failures"] += 1
                log.warning("adapter %r from %s: %s (%r)", name, url, exc.reason, exc.__cause__)
                raise
        return None

    def due(self, folder: Path) -> bool:
        """Whether the cached adapter in `folder` is due to be listed again (its TTL has passed)."""
        return self.cache.entry_of(folder) is not None and \
            time.monotonic() - self._listed.get(folder, 0.0) >= self.ttl_s

    def current(self, name: str, folder: Path, busy: Callable[[CacheEntry], bool]) -> Fetched | None:
        """A loaded adapter checked against its source once its TTL has passed: None while it is current (or not
        due); else the new version, fetched. A StoreError when the source cannot be read (the next try waits
        for the TTL again: a store that is down is not asked on every request)."""
        entry = self.cache.entry_of(folder)
        if entry is None or not self.due(folder):
            return None
        self._listed[folder] = time.monotonic()
        fetched = self.fetch(name, (entry.source,), busy)
        if fetched is not None and fetched.folder == folder:
            return None
        return fetched

    def _cached(self, source: S3Source, name: str, objects: list[StoredObject],
                busy: Callable[[CacheEntry], bool]) -> Fetched:
        folder = self.cache.folder_of(source.identity, name, objects)
        with self._flight(folder):
            self._listed[folder] = time.monotonic()
            entry = self.cache.lookup(folder)
            if entry is not None:
                self.counts["cache_hits"] += 1
                self.cache.touch(entry)
                return Fetched(folder, source.url, False)
            self.counts["cache_misses"] += 1
            self._download(source, name, objects, folder)
        evicted = self.cache.evict(lambda e: e.folder == folder or e.folder in self._flights or busy(e))
        self.counts["evictions"] += len(evicted)
        for entry in evicted:
            self._listed.pop(entry.folder, None)
        return Fetched(folder, source.url, True, tuple(evicted))

    def _download(self, source: S3Source, name: str, objects: list[StoredObject], folder: Path) -> None:
        part = self.cache.staging(folder)
        try:
            files = {}
            for obj in objects:
                digest = source.download(obj, part / obj.file)
                files[obj.file] = {"size": obj.size, "etag": obj.etag, "sha256": digest}
            self.cache.install(part, folder, source.url, name, files)
        except BaseException:
            self.cache.discard(part)
            raise
        self.counts["downloads"] += 1
        self.counts["download_bytes"] += sum(o.size for o in objects)
        log.info("adapter %r downloaded from %s (%d bytes)", name, source.url, sum(o.size for o in objects))

    def _flight(self, folder: Path) -> "_Flight":
        with self._lock:
            lock = self._flights.setdefault(folder, threading.Lock())
        return _Flight(self, folder, lock)


class _Flight:
    """Holds a version's download lock; the last holder out forgets it."""

    def __init__(self, store: AdapterStore, folder: Path, lock: threading.Lock) -> None:
        self.store, self.folder, self.lock = store, folder, lock

    def __enter__(self):
        self.lock.acquire()
        return self

    def __exit__(self, *exc):
        self.lock.release()
        with self.store._lock:
            if not self.lock.locked() and self.store._flights.get(self.folder) is self.lock:
                del self.store._flights[self.folder]
        return False
