"""One batch run to its end: its lines answered, each once, then its output and error files.

Lines run as in-process requests (api/batch/line_call.py), at most `concurrency` at once, so a big
batch never floods the engine's queue. A 429 or 503 (a tenant's limit, a full queue, an engine
restarting) is not the line's answer: it is asked again after the Retry-After (else a growing
backoff), for as long as the batch is neither cancelled nor expired. Every other answer is final
and journaled (fsync'd) before it counts, so after a crash the batch resumes with the lines not
in the journal. The lines that cannot be requests (api/batch/batch_lines.py) are answered first,
each with its 400, without running.

Cancel: no line starts after it and no retry is made; the lines already running finish and are
kept (OpenAI's behaviour); then the batch is `cancelled` with the files of what was answered (a
line never started is in neither file; the total still counts it). At
expiry (24 h) the same, but the lines never answered go to the error file as `batch_expired`.
The files are written at the end in input order; their ids follow from the batch's id, so a
crash while they are written writes the same files again."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from typing import Callable

from loraplex.api.batch.batch_lines import Line, read_lines
from loraplex.api.batch.batch_store import BatchRecord, BatchStore
from loraplex.api.batch.durable import Journal
from loraplex.api.batch.file_store import FileStore
from loraplex.api.batch.line_call import call_line
from loraplex.api.openai.openai_format import error_body
from loraplex.api.tenancy.callers import Caller

log = logging.getLogger(__name__)

RETRIED = (429, 503)
FIRST_BACKOFF_S, MAX_BACKOFF_S, MIN_WAIT_S = 0.5, 30.0, 0.05
ORPHANED = "the tenant that created this batch is no longer in the tenants file"
EXPIRED = "this line was not run before the batch's completion window ended"


def result_line(line: Line, status: int, body: dict) -> dict:
    """A line's answer as OpenAI writes it in a batch's output and error files."""
    request_id = body.get("id") if status == 200 and isinstance(body.get("id"), str) else f"req_{uuid.uuid4().hex}"
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body}, "error": None}


def expired_line(line: Line) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id, "response": None,
            "error": {"code": "batch_expired", "message": EXPIRED}}


def output_ids(batch_id: str) -> tuple[str, str]:
    """The output and error files' ids: the same however often a batch is finished (no random
    hex has the letters, so no uploaded file's id is one of these)."""
    tag = batch_id.removeprefix("batch_")[:22]
    return f"file-{tag}out", f"file-{tag}err"


class BatchRunner:
    def __init__(self, record: BatchRecord, store: BatchStore, files: FileStore, app,
                 caller: Callable[[], Caller | None], concurrency: int, lines: list[Line] | None = None,
                 slots: asyncio.Semaphore | None = None) -> None:
        """`app`: the ASGI app the lines are sent to; `caller`: whom they run as, asked per line;
        `lines`: the input's lines when already read (at creation), else read from the input file; `slots`: the
        server's lines in flight over all its batches (none: this batch's `concurrency` alone bounds them)."""
        self.record, self.store, self.files, self.app = record, store, files, app
        self.caller, self.concurrency, self.lines = caller, concurrency, lines
        self.slots = slots or asyncio.Semaphore(concurrency)
        self.journal: Journal = store.journal(record.id)
        self.cancelled = asyncio.Event()

    def cancel(self) -> None:
        self.cancelled.set()

    async def run(self) -> None:
        try:
            await self._run()
        except Exception:  # a bug: the batch ends failed, said, never left running without a runner
            log.exception("batch %s failed", self.record.id)
            await self._fail("server_error", "the batch failed on the server; see the server log")

    async def _run(self) -> None:
        record = self.record
        lines = self.lines if self.lines is not None else await self._read_input()
        if lines is None:
            return
        self.lines = lines
        index = await asyncio.to_thread(self.journal.scan)
        answered = [index[line.number][1] for line in lines if line.number in index]
        record.completed, record.failed = sum(answered), len(answered) - sum(answered)
        if record.status in ("validating", "in_progress"):
            if record.status == "validating":
                record.enter("in_progress")
                await self.store.save(record)
            todo = [line for line in lines if line.number not in index]
            await self._answer_malformed([line for line in todo if line.problem is not None])
            await self._run_lines([line for line in todo if line.problem is None])
            index = await asyncio.to_thread(self.journal.scan)
        await self._finish(lines, index)

    async def _read_input(self) -> list[Line] | None:
        """The input file's lines (after a restart); None when the file is gone: the batch failed."""
        stored = self.files.get(self.record.owner, self.record.input_file_id)
        if stored is None:
            await self._fail("input_file_missing", f"the input file {self.record.input_file_id} was deleted before "
                                                   f"the batch could finish", "input_file_id")
            return None
        data = await asyncio.to_thread(self.files.read, stored)
        return await asyncio.to_thread(read_lines, data, self.record.endpoint)

    # ---- running the lines ------------------------------------------------------------------

    def _stopping(self) -> bool:
        return self.cancelled.is_set() or self.record.status != "in_progress" or self._expired()

    def _expired(self) -> bool:
        return time.time() >= self.record.expires_at

    async def _answer_malformed(self, malformed: list[Line]) -> None:
        """The lines that cannot be requests, answered at once with their 400s (one fsync for all): they
        need no engine, so a cancel or an expiry never leaves them unanswered."""
        if malformed:
            await asyncio.to_thread(self.journal.append_all, [
                {"line": line.number, "ok": False, "result": result_line(line, 400, error_body(400, line.problem,
                                                                                               line.param))}
                for line in malformed])
            self.record.failed += len(malformed)

    async def _run_lines(self, todo: list[Line]) -> None:
        pending = iter(todo)

        async def worker() -> None:
            for line in pending:  # shared: each line is taken by one worker
                if self._stopping():
                    return
                answer = await self._answer(line)
                if answer is None:  # stopped while waiting to retry: not answered
                    return
                ok, result = answer
                await asyncio.to_thread(self.journal.append, {"line": line.number, "ok": ok, "result": result})
                if ok:
                    self.record.completed += 1
                else:
                    self.record.failed += 1

        workers = [asyncio.ensure_future(worker()) for _ in range(min(self.concurrency, len(todo)))]
        if not workers:
            return
        try:  # one failing (a bug) stops the others: nothing is journaled once the batch is failed
            done, _ = await asyncio.wait(workers, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                if task.exception() is not None:
                    raise task.exception()
        finally:
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)

    async def _answer(self, line: Line) -> tuple[bool, dict] | None:
        """(whether it succeeded, its result line); None when the batch stopped before it was answered."""
        attempt = 0
        while True:
            caller = self.caller()
            if caller is None:
                return False, result_line(line, 403, error_body(403, ORPHANED))
            async with self.slots:
                answer = await call_line(self.app, caller, self.record.endpoint, line.body)
            if answer.status not in RETRIED:
                return answer.status == 200, result_line(line, answer.status, answer.body)
            wait = answer.retry_after if answer.retry_after is not None else FIRST_BACKOFF_S * 2 ** attempt
            attempt += 1
            if not await self._pause(min(max(wait, MIN_WAIT_S), MAX_BACKOFF_S)):
                return None

    async def _pause(self, seconds: float) -> bool:
        """Wait before a retry; False when the batch was cancelled or expired meanwhile."""
        left = self.record.expires_at - time.time()
        if left <= 0:
            return False
        try:
            await asyncio.wait_for(self.cancelled.wait(), min(seconds, left))
            return False
        except asyncio.TimeoutError:
            return not self._stopping()

    # ---- the end ------------------------------------------------------------------------------

    async def _finish(self, lines: list[Line], index: dict[int, tuple[int, bool]]) -> None:
        record = self.record
        if record.status == "cancelling":
            final, expired = "cancelled", []
        else:
            expired = [line for line in lines if line.number not in index]  # none unless it expired
            final = "expired" if expired else "completed"
            if record.status != "finalizing":
                record.enter("finalizing")
                await self.store.save(record)
        output_id, error_id = await asyncio.to_thread(self._write_files, lines, index, expired)
        record.failed += len(expired)
        record.output_file_id, record.error_file_id = output_id, error_id
        record.enter(final)
        await self.store.save(record)
        await asyncio.to_thread(self.journal.path.unlink, missing_ok=True)  # its answers are in the files now
        log.info("batch %s %s: %d completed, %d failed of %d", record.id, final, record.completed, record.failed,
                 record.total)

    def _write_files(self, lines: list[Line], index: dict[int, tuple[int, bool]],
                     expired: list[Line]) -> tuple[str | None, str | None]:
        """The output and error files, in input order (in a worker thread)."""
        def results(ok: bool):
            with open(self.journal.path, "rb") if index else contextlib.nullcontext() as journal:
                late = {line.number for line in expired}
                for line in lines:
                    if line.number in index and index[line.number][1] == ok:
                        result = self.journal.entry_at(journal, index[line.number][0])["result"]
                    elif not ok and line.number in late:
                        result = expired_line(line)
                    else:
                        continue
                    yield json.dumps(result, separators=(",", ":")).encode() + b"\n"

        owner, batch_id = self.record.owner, self.record.id
        output_id, error_id = output_ids(batch_id)
        has_ok = any(ok for _, ok in index.values())
        has_errors = bool(expired) or not all(ok for _, ok in index.values())
        if has_ok:
            self.files.add(owner, f"{batch_id}_output.jsonl", "batch_output", results(True), file_id=output_id)
        if has_errors:
            self.files.add(owner, f"{batch_id}_error.jsonl", "batch_output", results(False), file_id=error_id)
        return (output_id if has_ok else None), (error_id if has_errors else None)

    async def _fail(self, code: str, message: str, param: str | None = None) -> None:
        self.record.errors = [{"code": code, "message": message, "param": param, "line": None}]
        await self._keep_answers()
        self.record.enter("failed")
        await self.store.save(self.record)

    async def _keep_answers(self) -> None:
        """The lines answered before the batch failed, into its output and error files: a finished batch's journal
        is dropped, and those answers were billed."""
        if self.lines is None:
            return
        try:
            index = await asyncio.to_thread(self.journal.scan)
            if index:
                self.record.output_file_id, self.record.error_file_id = await asyncio.to_thread(
                    self._write_files, self.lines, index, [])
        except Exception:
            log.exception("batch %s: the lines answered before it failed could not be written", self.record.id)

