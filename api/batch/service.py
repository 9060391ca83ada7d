"""The Files and Batch APIs of one server: its two stores in `batch_dir`, and a runner task per
unfinished batch. `start` (the app's lifespan, api/batch/routes_batches.py) resumes every batch a
previous run left unfinished; `stop` cancels the runners without finishing their batches (a line
running then is run again at the next start: it was never journaled)."""

from __future__ import annotations

import asyncio
import fcntl
import logging
from pathlib import Path

from loraplex.api.batch.batch_lines import Line, read_lines, repeated_custom_id
from loraplex.api.batch.batch_runner import BatchRunner
from loraplex.api.batch.batch_store import BatchRecord, BatchStore
from loraplex.api.batch.file_store import FileStore
from loraplex.api.batch.owners import caller_for
from loraplex.api.errors import APIError
from loraplex.api.settings import ServerConfig
from loraplex.api.tenancy.tenants import TenantRegistry

log = logging.getLogger(__name__)

CANCELLABLE = ("validating", "in_progress")


class BatchService:
    def __init__(self, config: ServerConfig, tenants: TenantRegistry) -> None:
        root = Path(config.batch_dir)
        self.config, self.tenants = config, tenants
        self.files = FileStore(root / "files")
        self.batches = BatchStore(root / "batches")
        self.root = root
        self._lock = None  # the folder's lock file, held while started: one server per folder
        self.runners: dict[str, BatchRunner] = {}
        self.slots: asyncio.Semaphore | None = None  # lines in flight over all batches (made on the loop)
        self.tasks: set[asyncio.Task] = set()
        self.app = None

    def start(self, app) -> None:
        """Resume the unfinished batches, their lines sent to `app` (once; on the running loop)."""
        if self.app is not None:
            return
        self._take_folder()
        self.app = app
        resumed = self.batches.unfinished()
        if resumed:
            log.info("resuming %d unfinished batch(es)", len(resumed))
        for record in resumed:
            self._launch(record)

    def _take_folder(self) -> None:
        """An exclusive lock on the folder: two servers over one folder would both resume its batches and run
        their lines twice (the lock goes with the process, a kill -9 included)."""
        self.root.mkdir(parents=True, exist_ok=True)
        lock = open(self.root / ".lock", "a")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise RuntimeError(f"another loraplex server uses the batch folder {self.root} (--batch-dir); give each "
                               "server its own") from None
        self._lock = lock

    async def stop(self) -> None:
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.tasks.clear()
        self.runners.clear()
        self.app = None
        if self._lock is not None:
            self._lock.close()  # the lock goes with it
            self._lock = None

    def _launch(self, record: BatchRecord, lines: list[Line] | None = None) -> None:
        self.slots = self.slots or asyncio.Semaphore(self.config.batch_concurrency)
        runner = BatchRunner(record, self.batches, self.files, self.app, lambda: caller_for(record.owner, self.tenants),
                             self.config.batch_concurrency, lines, self.slots)
        self.runners[record.id] = runner
        task = asyncio.ensure_future(runner.run())
        self.tasks.add(task)
        task.add_done_callback(lambda done: self._ended(record.id, done))

    def _ended(self, batch_id: str, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        self.runners.pop(batch_id, None)
        if not task.cancelled() and task.exception() is not None:
            log.error("batch %s: its runner stopped", batch_id, exc_info=task.exception())

    async def create(self, owner: str, app, input_file_id: str, endpoint: str,
                     metadata: dict[str, str] | None) -> BatchRecord:
        """A batch over the owner's input file, validated whole first (a 400 for what makes the batch
        itself unusable; a malformed line is not that: it is answered with its own 400)."""
        try:
            self.start(app)  # a host that ran no lifespan resumes here instead (before this batch exists)
        except RuntimeError as exc:  # the folder is another server's
            raise APIError(503, str(exc)) from None
        stored = self.files.get(owner, input_file_id)
        if stored is None:
            raise APIError(404, f"No such File object: {input_file_id}", "input_file_id")
        if stored.purpose != "batch":
            raise APIError(400, f"the input file's purpose is {stored.purpose!r}; a batch's input is uploaded with "
                                f"purpose \"batch\"", "input_file_id")
        data = await asyncio.to_thread(self.files.read, stored)
        lines = await asyncio.to_thread(read_lines, data, endpoint)
        if not lines:
            raise APIError(400, "the input file holds no request lines", "input_file_id")
        if len(lines) > self.config.max_batch_lines:
            raise APIError(400, f"the input file holds {len(lines)} request lines; a batch takes at most "
                                f"{self.config.max_batch_lines} (max_batch_lines)", "input_file_id")
        repeated = repeated_custom_id(lines)
        if repeated is not None:
            raise APIError(400, repeated, "input_file_id")
        record = BatchRecord.new(owner, endpoint, input_file_id, len(lines), metadata)
        await self.batches.save(record)
        self._launch(record, lines)
        return record

    async def cancel(self, record: BatchRecord) -> BatchRecord:
        """`cancelling` until the lines in flight are answered, then `cancelled` (the runner's end);
        a batch already cancelling or cancelled is answered as it is."""
        if record.status in ("cancelling", "cancelled"):
            return record
        if record.status not in CANCELLABLE:
            raise APIError(409, f"batch {record.id} is {record.status}; only a batch in progress can be cancelled")
        record.enter("cancelling")
        await self.batches.save(record)
        runner = self.runners.get(record.id)
        if runner is not None:
            runner.cancel()
        elif self.app is not None:  # no runner (cannot happen while started): finish it now
            self._launch(record)
        return record
