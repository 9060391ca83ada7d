"""Writes that survive a kill -9 or a power cut, for the Files and Batch APIs' folder.

A record or a file's content is written whole or not at all: into a temporary file beside it,
fsync'd, renamed over the old one (`os.replace` is atomic), then the folder fsync'd so the rename
itself is on disk. A batch's results go to a journal (one JSON object a line, fsync'd per line):
a crash can leave only its last line torn, which `Journal.scan` drops (and cuts off, so the next
append starts on a line of its own)."""

from __future__ import annotations

import json
import logging
import os
import threading
import uuid
from pathlib import Path
from typing import BinaryIO, Iterable

log = logging.getLogger(__name__)

CHUNK = 1 << 20


class TooLarge(ValueError):
    """What was written grew past its limit (nothing was kept)."""


def fsync_folder(folder: Path) -> None:
    """A rename or an unlink in `folder` made durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, chunks: Iterable[bytes], limit: int | None = None) -> int:
    """`chunks` as the whole content of `path`, or nothing at all (TooLarge past `limit` bytes, or
    any error: the temporary file is removed). Returns the bytes written."""
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    size = 0
    try:
        with open(temporary, "wb") as out:
            for chunk in chunks:
                size += len(chunk)
                if limit is not None and size > limit:
                    raise TooLarge(f"larger than {limit} bytes")
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    fsync_folder(path.parent)
    return size


def write_json(path: Path, value) -> None:
    write_atomically(path, [json.dumps(value, separators=(",", ":")).encode()])


def read_chunks(source: BinaryIO) -> Iterable[bytes]:
    while chunk := source.read(CHUNK):
        yield chunk


def remove(path: Path) -> None:
    """`path` gone, durably (missing already is fine)."""
    try:
        path.unlink()
    except FileNotFoundError:
        return
    fsync_folder(path.parent)


def remove_temporaries(folder: Path) -> None:
    """Temporary files a crash left behind (never renamed into place: never part of anything)."""
    for path in folder.glob(".*.tmp"):
        path.unlink(missing_ok=True)


class Journal:
    """An append-only JSONL file of results, each line fsync'd before `append` returns. Appends come
    from worker threads (the fsync off the event loop), one at a time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()

    def scan(self) -> dict[int, tuple[int, bool]]:
        """Each journaled input line's number -> (offset of its entry, whether it succeeded); a
        torn or unreadable last line is dropped and cut off the file. A line journaled twice keeps its
        first entry (it cannot happen: a line is journaled once, after it ran)."""
        index: dict[int, tuple[int, bool]] = {}
        if not self.path.exists():
            return index
        good_end = 0
        with open(self.path, "rb") as journal:
            offset = 0
            for raw in journal:
                entry = _entry(raw)
                if entry is not None:
                    index.setdefault(entry["line"], (offset, bool(entry["ok"])))
                    good_end = offset + len(raw)
                elif raw.endswith(b"\n"):  # a whole line that is not an entry: skipped, kept
                    log.warning("%s: an unreadable entry at byte %d skipped", self.path.name, offset)
                    good_end = offset + len(raw)
                offset += len(raw)
        if good_end < offset:
            log.warning("%s: a torn last entry (%d bytes) dropped", self.path.name, offset - good_end)
            with open(self.path, "r+b") as journal:
                journal.truncate(good_end)
                os.fsync(journal.fileno())
        return index

    def entry_at(self, journal: BinaryIO, offset: int) -> dict:
        journal.seek(offset)
        return json.loads(journal.readline())

    def append(self, entry: dict) -> None:
        self.append_all([entry])

    def append_all(self, entries: list[dict]) -> None:
        """`entries`, each on a line of its own, durable together (one fsync)."""
        data = b"".join(json.dumps(entry, separators=(",", ":")).encode() + b"\n" for entry in entries)
        with self._lock:
            created = not self.path.exists()
            with open(self.path, "ab") as journal:
                journal.write(data)
                journal.flush()
                os.fsync(journal.fileno())
            if created:
                fsync_folder(self.path.parent)


def _entry(raw: bytes) -> dict | None:
    """A complete journal line's entry, or None (torn: no newline; or not an entry)."""
    if not raw.endswith(b"\n"):
        return None
    try:
        entry = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(entry, dict) or not isinstance(entry.get("line"), int) or "ok" not in entry:
        return None
    return entry
