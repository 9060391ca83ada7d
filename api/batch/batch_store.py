"""Batches on disk: `batches/<id>.json` (the record, written atomically at each change of status)
and `batches/<id>.journal.jsonl` (each answered line as it is answered, api/batch/durable.py).
The counts of a running batch live in memory; after a restart they are counted again from its
journal, which is what they count. Lookups are by owner, as the file store's."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from loraplex.api.batch import durable

log = logging.getLogger(__name__)

COMPLETION_WINDOW_S = 24 * 3600
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
# the status whose time each status sets (OpenAI's `<status>_at` fields)
STAMPED = ("in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled")


@dataclass
class BatchRecord:
    id: str
    owner: str
    endpoint: str
    input_file_id: str
    created_at: int
    expires_at: int
    total: int  # request lines in the input file
    created_ns: int  # orders listings: many batches share a second
    status: str = "in_progress"
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None
    completed: int = 0
    failed: int = 0
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict] | None = None  # why the batch itself failed (OpenAI's BatchError objects)
    stamps: dict[str, int] = field(default_factory=dict)  # status -> when it was entered

    @classmethod
    def new(cls, owner: str, endpoint: str, input_file_id: str, total: int, metadata: dict | None) -> "BatchRecord":
        now = time.time_ns()
        record = cls(f"batch_{uuid.uuid4().hex}", owner, endpoint, input_file_id, now // 10**9,
                     now // 10**9 + COMPLETION_WINDOW_S, total, now, metadata=metadata)
        record.stamps["in_progress"] = record.created_at
        return record

    def enter(self, status: str) -> None:
        self.status = status
        self.stamps.setdefault(status, int(time.time()))

    @property
    def finished(self) -> bool:
        return self.status not in UNFINISHED

    def to_openai(self) -> dict:
        """The Batch object as OpenAI answers it (openai.types.Batch)."""
        return {"id": self.id, "object": "batch", "endpoint": self.endpoint,
                "errors": {"object": "list", "data": self.errors} if self.errors else None,
                "input_file_id": self.input_file_id, "completion_window": self.completion_window,
                "status": self.status, "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
                "created_at": self.created_at, "expires_at": self.expires_at,
                **{f"{status}_at": self.stamps.get(status) for status in STAMPED},
                "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
                "metadata": self.metadata}


class BatchStore:
    """Records are changed on the event loop; `save` writes a snapshot taken there, one save at a
    time, so the file always ends at the latest state."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self._batches: dict[str, BatchRecord] = {}
        self._saving: asyncio.Lock | None = None
        durable.remove_temporaries(folder)
        for path in folder.glob("batch_*.json"):
            try:
                record = BatchRecord(**json.loads(path.read_bytes()))
            except (ValueError, TypeError) as exc:
                log.error("%s: not a batch record (%s); left alone", path, exc)
                continue
            self._batches[record.id] = record
        for record in self._batches.values():  # a crash after a batch's end was saved, before its journal went
            if record.finished:
                self.journal(record.id).path.unlink(missing_ok=True)

    def journal(self, batch_id: str) -> durable.Journal:
        return durable.Journal(self.folder / f"{batch_id}.journal.jsonl")

    async def save(self, record: BatchRecord) -> None:
        if self._saving is None:
            self._saving = asyncio.Lock()
        async with self._saving:
            snapshot = asdict(record)
            await asyncio.to_thread(durable.write_json, self.folder / f"{record.id}.json", snapshot)
        self._batches[record.id] = record

    def get(self, owner: str, batch_id: str) -> BatchRecord | None:
        record = self._batches.get(batch_id)
        return record if record is not None and record.owner == owner else None

    def list(self, owner: str) -> list[BatchRecord]:
        """The owner's batches, newest first."""
        return sorted((b for b in self._batches.values() if b.owner == owner), key=lambda b: b.created_ns,
                      reverse=True)

    def unfinished(self) -> list[BatchRecord]:
        return sorted((b for b in self._batches.values() if not b.finished), key=lambda b: b.created_ns)
