"""The Files API's files on disk: `files/<id>.data` (the content) and `files/<id>.json` (its
record: owner, name, purpose, size, time), each written atomically, the content first: a crash
between the two leaves a content file without a record, removed at the next start, never a record
without its content. Every lookup is by owner: another owner's id is as unknown as a missing one."""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO, Iterable

from loraplex.api.batch import durable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoredFile:
    id: str
    owner: str  # api/batch/owners.py: who may see it
    filename: str
    purpose: str  # "batch" (uploaded) or "batch_output" (a batch's output or error file)
    bytes: int
    created_at: int
    created_ns: int  # orders listings: many files share a second

    def to_openai(self) -> dict:
        """The File object as OpenAI answers it (openai.types.FileObject)."""
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed", "expires_at": None,
                "status_details": None}


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex[:24]}"


class FileStore:
    """Thread-safe: contents are written and read in worker threads, off the event loop."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._files: dict[str, StoredFile] = {}
        self._load()

    def _load(self) -> None:
        durable.remove_temporaries(self.folder)
        for record in self.folder.glob("*.json"):
            try:
                stored = StoredFile(**json.loads(record.read_bytes()))
            except (ValueError, TypeError) as exc:
                log.error("%s: not a file record (%s); left alone", record, exc)
                continue
            if self.content_path(stored.id).exists():
                self._files[stored.id] = stored
            else:
                log.error("%s: its content is missing; the file is dropped", record)
                record.unlink()
        for content in self.folder.glob("*.data"):
            if content.stem not in self._files:  # a crash before its record was written
                content.unlink()

    def content_path(self, file_id: str) -> Path:
        return self.folder / f"{file_id}.data"

    def add(self, owner: str, filename: str, purpose: str, chunks: Iterable[bytes], limit: int | None = None,
            file_id: str | None = None) -> StoredFile:
        """A new file (or, with `file_id`, that file written again: a batch's outputs after a restart)
        from `chunks`; TooLarge past `limit` bytes, with nothing kept."""
        file_id = file_id or new_file_id()
        size = durable.write_atomically(self.content_path(file_id), chunks, limit)
        now = time.time_ns()
        stored = StoredFile(file_id, owner, filename, purpose, size, now // 10**9, now)
        durable.write_json(self.folder / f"{file_id}.json", asdict(stored))
        with self._lock:
            self._files[file_id] = stored
        return stored

    def get(self, owner: str, file_id: str) -> StoredFile | None:
        with self._lock:
            stored = self._files.get(file_id)
        return stored if stored is not None and stored.owner == owner else None

    def list(self, owner: str, purpose: str | None = None) -> list[StoredFile]:
        """The owner's files, newest first."""
        with self._lock:
            files = [f for f in self._files.values() if f.owner == owner and purpose in (None, f.purpose)]
        return sorted(files, key=lambda f: f.created_ns, reverse=True)

    def open(self, stored: StoredFile) -> BinaryIO:
        """The content, open for reading (a delete meanwhile does not cut a download short)."""
        return open(self.content_path(stored.id), "rb")

    def read(self, stored: StoredFile) -> bytes:
        with self.open(stored) as content:
            return content.read()

    def delete(self, owner: str, file_id: str) -> bool:
        """The record goes first: a crash between leaves content without a record, removed at start."""
        with self._lock:
            stored = self._files.get(file_id)
            if stored is None or stored.owner != owner:
                return False
            del self._files[file_id]
        durable.remove(self.folder / f"{file_id}.json")
        durable.remove(self.content_path(file_id))
        return True
