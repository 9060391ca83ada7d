"""The registry's disk tier: an adapter's prepared weights (read, checked, fused, in the engine's dtype) kept
in one flat file, so bringing an adapter the CPU cache dropped back costs one sequential read instead of
parsing, checking, hashing and fusing its PEFT folder again (`docs/adapters.md` has the numbers).

An adapter is written when the CPU cache drops it (`keep`), by this store's own thread: neither a load nor a step
waits on the disk. Until its file is written, a read gets the weights still queued for it.

Only adapters whose every byte is in their projections' A and B are kept here (the plain LoRA most trainers
write, rank patterns included); the rest are read from their folder again. The files live in a private folder
made for this process (removed when the registry goes) and are bounded in bytes, least recently used dropped
first. A file holds what was validated when the adapter was loaded: it never changes under a name.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import shutil
import tempfile
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplex.adapters.peft_format import LoRAWeights

log = logging.getLogger(__name__)

Key = tuple[int, str]
PAGE = 4096
MAX_PENDING = 16  # adapters queued for the writer: what the disk tier may hold in memory beyond the CPU cache


@dataclass(frozen=True)
class Spilled:
    """Where an adapter's projections are in its file: per key, A's and B's shapes, in file order."""

    path: Path
    content_hash: str
    nbytes: int
    layout: tuple[tuple[Key, torch.Size, torch.Size], ...]
    husk: LoRAWeights  # everything else: names, scales, terms without tensors, kinds


def spillable(weights: LoRAWeights) -> bool:
    """Whether all of an adapter's bytes are its projections' (nothing else to keep beside the file)."""
    return bool(weights.projections) and weights.nbytes == _projection_bytes(weights) and weights.tokenizer is None


def _projection_bytes(weights: LoRAWeights) -> int:
    return sum(a.nbytes + b.nbytes for a, b in weights.projections.values())


class SpillStore:
    def __init__(self, max_bytes: int, root: str | None = None) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._files: OrderedDict[str, Spilled] = OrderedDict()  # LRU, most recent last
        self._bytes = 0
        self._folder: Path | None = None
        self._root = root
        self._pending: dict[str, LoRAWeights] = {}  # queued for the writer, by name
        self._queue: queue.Queue = queue.Queue(maxsize=MAX_PENDING)
        self._writer: threading.Thread | None = None

    def _ensure_folder(self) -> Path:
        if self._folder is None:
            self._folder = Path(tempfile.mkdtemp(prefix="loraplex-adapters-", dir=self._root))
            weakref.finalize(self, shutil.rmtree, str(self._folder), True)
        return self._folder

    def has(self, name: str, content_hash: str) -> bool:
        with self._lock:
            held = self._files.get(name) or self._pending.get(name)
            return held is not None and held.content_hash == content_hash

    def keep(self, weights: LoRAWeights) -> None:
        """Write `weights` in the background (the CPU cache is dropping them; cheap, never blocks: with
        `MAX_PENDING` writes queued already it is not kept, and comes from its folder when next needed)."""
        if self.max_bytes <= 0 or self.has(weights.name, weights.content_hash) or not spillable(weights):
            return  # `has` first: a dict lookup, where `spillable` sums every projection's bytes
        with self._lock:
            if self._writer is None:
                # the thread holds the store weakly: a store nobody closes is still freed (and its thread ends)
                self._writer = threading.Thread(target=_write_queued, args=(self._queue, weakref.ref(self)),
                                                name="loraplex-spill", daemon=True)
                self._writer.start()
                weakref.finalize(self, _stop_writer, self._queue)
            try:
                self._queue.put_nowait(weights)
            except queue.Full:
                return
            self._pending[weights.name] = weights

    def flush(self) -> None:
        """Until every queued write is done (tests)."""
        self._queue.join()

    def close(self) -> None:
        """Stop the writer and remove every file (the engine is closing)."""
        with self._lock:
            writer, self.max_bytes = self._writer, 0  # nothing more is kept
            self._pending.clear()
        if writer is not None:
            self._queue.put(None)
            writer.join(10)
        with self._lock:
            for name in list(self._files):
                self._forget(name)
            if self._folder is not None:
                shutil.rmtree(self._folder, ignore_errors=True)

    def _still_pending(self, weights: LoRAWeights) -> bool:
        """Not dropped, replaced or closed since it was queued (the caller holds the lock)."""
        return self._pending.get(weights.name) is weights

    def _write_one(self, weights: LoRAWeights) -> None:
        try:
            with self._lock:
                wanted = self._still_pending(weights)
            if wanted:
                self._write(weights)
        except Exception:  # noqa: BLE001  the adapter is read from its folder instead
            log.warning("adapter %r not kept on disk", weights.name, exc_info=True)
        finally:
            with self._lock:
                if self._pending.get(weights.name) is weights:
                    del self._pending[weights.name]

    def _write(self, weights: LoRAWeights) -> None:
        """Keep queued `weights`' projections on disk (the writer's thread: one sequential write), unless larger than
        the whole budget, refused by the disk, or no longer pending once written."""
        nbytes = _projection_bytes(weights)
        if nbytes > self.max_bytes:
            return
        layout = tuple((key, a.shape, b.shape) for key, (a, b) in weights.projections.items())
        parts = [t.contiguous().reshape(-1).view(torch.uint8) for _, (a, b) in weights.projections.items()
                 for t in (a, b)]
        with self._lock:
            folder = self._ensure_folder()
        path = folder / f"{weights.content_hash[:16]}-{os.urandom(4).hex()}.bin"
        try:
            with open(path, "wb") as out:
                for part in parts:
                    out.write(part.numpy())
        except OSError as exc:
            log.warning("adapter %r not kept on disk (%s); it is read from its folder when needed", weights.name, exc)
            path.unlink(missing_ok=True)
            return
        husk = dataclasses.replace(weights, projections={})
        with self._lock:
            if not self._still_pending(weights):  # dropped, replaced or closed while written
                path.unlink(missing_ok=True)
                return
            self._forget(weights.name)
            self._files[weights.name] = Spilled(path, weights.content_hash, nbytes, layout, husk)
            self._bytes += nbytes
            self._trim(keep=weights.name)

    def read(self, name: str, content_hash: str, dtype: torch.dtype) -> LoRAWeights | None:
        """The adapter's weights back: still queued (in memory), else a prefaulted mapping of its file; None: not kept
        here."""
        with self._lock:
            queued = self._pending.get(name)
            if queued is not None and queued.content_hash == content_hash:
                return queued  # still in memory, waiting for the writer
            held = self._files.get(name)
            if held is None or held.content_hash != content_hash:
                return None
            self._files.move_to_end(name)
        try:
            # a private mapping of the file: its pages are the page cache's, returned whole when the weights go (no
            # heap to fragment); one byte a page read here, so the faults are this thread's, never a step's
            raw = torch.from_file(str(held.path), shared=False, size=held.nbytes, dtype=torch.uint8)
            raw[::PAGE].sum()
        except (OSError, RuntimeError) as exc:
            log.warning("adapter %r: its file on disk could not be read (%s); reading its folder", name, exc)
            self.drop(name)
            return None
        flat, offset, projections = raw.view(dtype), 0, {}
        for key, a_shape, b_shape in held.layout:
            a = flat[offset:offset + a_shape.numel()].view(a_shape)
            offset += a_shape.numel()
            b = flat[offset:offset + b_shape.numel()].view(b_shape)
            offset += b_shape.numel()
            projections[key] = (a, b)
        return dataclasses.replace(held.husk, projections=projections)

    def drop(self, name: str) -> None:
        with self._lock:
            self._pending.pop(name, None)
            self._forget(name)

    def usage(self) -> tuple[int, int]:
        """(adapters, bytes) kept on disk now."""
        with self._lock:
            return len(self._files), self._bytes

    def _forget(self, name: str) -> None:
        held = self._files.pop(name, None)
        if held is not None:
            self._bytes -= held.nbytes
            held.path.unlink(missing_ok=True)

    def _trim(self, keep: str) -> None:
        while self._bytes > self.max_bytes:
            oldest = next((n for n in self._files if n != keep), None)
            if oldest is None:
                return
            self._forget(oldest)


def _stop_writer(pending: queue.Queue) -> None:
    """The store is gone: wake its writer (never blocking: it may be the writer that dropped the last reference,
    and with the queue full the writer ends at its next item anyway, finding the store gone)."""
    try:
        pending.put_nowait(None)
    except queue.Full:
        pass


def _write_queued(pending: queue.Queue, store_ref: weakref.ref) -> None:
    """The writer's loop: each queued adapter written while the store lives; None (closed or freed) ends it."""
    while True:
        weights = pending.get()
        store = store_ref() if weights is not None else None
        try:
            if store is None:
                return
            store._write_one(weights)
        finally:
            pending.task_done()
            del store
