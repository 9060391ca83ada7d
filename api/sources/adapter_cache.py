"""The local disk cache of adapters fetched from object storage (`--adapter-cache-dir`, bounded by
`--adapter-cache-size` bytes).

Layout: `<dir>/<source digest>/<name>/<version>/` holding the adapter's files and `manifest.json` (the source,
each file's size, ETag and SHA-256). The version is a digest of the objects' keys, sizes and ETags, so a changed
object is a new folder, never an overwrite. An entry appears only whole: files are downloaded into a `.part-*`
folder beside it and renamed into place once verified. At start every entry is read again and one whose files no
longer match their manifest is removed, as are leftover `.part-*` folders. Eviction takes the least recently used
entries until the bound holds, never one that `busy` names (loaded into the engine and in use, or being fetched).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from loraplex.api.sources.s3_source import StoredObject

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class CacheEntry:
    source: str  # the source's URL, as the operator wrote it
    name: str
    folder: Path
    nbytes: int


def source_digest(identity: str) -> str:
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def version_of(objects: list[StoredObject]) -> str:
    text = "\n".join(f"{o.key}\t{o.size}\t{o.etag}" for o in sorted(objects, key=lambda o: o.key))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class AdapterCache:
    def __init__(self, folder: str | os.PathLike, max_bytes: int) -> None:
        self.folder, self.max_bytes = Path(folder).expanduser(), max_bytes
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._entries: OrderedDict[Path, CacheEntry] = OrderedDict()  # least recently used first
        self._scan()

    # ---- reading ---------------------------------------------------------------------------------------------

    def folder_of(self, identity: str, name: str, objects: list[StoredObject]) -> Path:
        return self.folder / source_digest(identity) / name / version_of(objects)

    def source_root(self, identity: str) -> Path:
        return self.folder / source_digest(identity)

    def lookup(self, folder: Path) -> CacheEntry | None:
        """The entry in `folder`, marked as just used; None when the cache does not hold it."""
        with self._lock:
            entry = self._entries.get(folder)
            if entry is not None:
                self._entries.move_to_end(folder)
            return entry

    def entry_of(self, path: str | os.PathLike) -> CacheEntry | None:
        """The entry a loaded adapter's folder is, if it came from this cache."""
        with self._lock:
            return self._entries.get(Path(path))

    def nbytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    # ---- writing ---------------------------------------------------------------------------------------------

    def staging(self, folder: Path) -> Path:
        """An empty folder beside `folder` to download into (renamed into place by `install`)."""
        folder.parent.mkdir(parents=True, exist_ok=True)
        part = folder.parent / f".part-{folder.name}-{os.getpid()}-{threading.get_ident()}-{time.monotonic_ns()}"
        part.mkdir()
        return part

    def install(self, part: Path, folder: Path, source: str, name: str, files: dict[str, dict]) -> CacheEntry:
        """The verified download in `part` as the entry `folder` (its manifest written last, then one rename)."""
        (part / MANIFEST).write_text(json.dumps({"source": source, "name": name, "files": files}))
        if folder.exists():  # the same version installed meanwhile: keep that one
            shutil.rmtree(part, ignore_errors=True)
        else:
            os.replace(part, folder)
        entry = CacheEntry(source, name, folder, sum(f["size"] for f in files.values()))
        with self._lock:
            self._entries[folder] = entry
            self._entries.move_to_end(folder)
        return entry

    def remove(self, folder: Path) -> None:
        """An entry out of the cache and off the disk."""
        with self._lock:
            self._entries.pop(folder, None)
        shutil.rmtree(folder, ignore_errors=True)

    def discard(self, part: Path) -> None:
        shutil.rmtree(part, ignore_errors=True)

    def evict(self, busy: Callable[[CacheEntry], bool]) -> list[CacheEntry]:
        """Least recently used entries out until the bound holds, skipping those `busy` says are in use; the ones
        removed."""
        removed = []
        with self._lock:
            total = sum(e.nbytes for e in self._entries.values())
            for folder, entry in list(self._entries.items()):
                if total <= self.max_bytes:
                    break
                if busy(entry):
                    continue
                del self._entries[folder]
                total -= entry.nbytes
                removed.append(entry)
        for entry in removed:
            shutil.rmtree(entry.folder, ignore_errors=True)
            log.info("adapter cache: evicted %r (%d bytes)", entry.name, entry.nbytes)
        return removed

    # ---- start -----------------------------------------------------------------------------------------------

    def _scan(self) -> None:
        """Entries left by an earlier run, each verified again (oldest use first); partial downloads removed."""
        found = []
        for part in self.folder.glob("*/*/.part-*"):
            shutil.rmtree(part, ignore_errors=True)
        for manifest in self.folder.glob(f"*/*/*/{MANIFEST}"):
            entry = _verified(manifest)
            if entry is None:
                log.warning("adapter cache: %s no longer matches its manifest; removed", manifest.parent.name)
                shutil.rmtree(manifest.parent, ignore_errors=True)
            else:
                found.append((manifest.stat().st_mtime, entry))
        for _, entry in sorted(found, key=lambda pair: pair[0]):
            self._entries[entry.folder] = entry

    def touch(self, entry: CacheEntry) -> None:
        """Its use remembered across restarts (the manifest's time orders the scan)."""
        try:
            os.utime(entry.folder / MANIFEST)
        except OSError:
            pass


def _verified(manifest: Path) -> CacheEntry | None:
    try:
        data = json.loads(manifest.read_text())
        files = data["files"]
        for file, meta in files.items():
            path = manifest.parent / file
            if path.stat().st_size != meta["size"] or _sha256(path) != meta["sha256"]:
                return None
        return CacheEntry(data["source"], data["name"], manifest.parent, sum(m["size"] for m in files.values()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
