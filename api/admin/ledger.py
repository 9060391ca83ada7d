"""The usage ledger: every answered request's usage (tenant, adapters, prompt / generation /
reasoning tokens) and every 429, one row each, kept in SQLite so a bill outlives the process.

Rows are appended from any thread without waiting on the disk: a writer thread takes whatever
has queued, inserts it in one transaction and commits (WAL, `synchronous=NORMAL`: a commit
survives the process's death, kill -9 or the OOM killer; an OS crash or a power cut may lose the
commits since the last WAL checkpoint), then takes the next batch; so a row is committed within
one commit of being recorded (group commit: the busier the server, the larger each transaction,
never one commit per row). A generation waits for `committed()` before its answer ends, so a
client that got a whole answer was billed durably. A row's id is its primary key, so a row written
twice (a Ray replica's report sent again after a lost answer) is billed once.

`usage(since, until)` sums the rows of a window, per tenant, per adapter (a mix counts for each
of its adapters), in total and per UTC day, after `flush` (what was recorded is read back).
`path` None keeps the ledger in memory only (a test's server, `--usage-db memory`)."""

from __future__ import annotations

import abc
import asyncio
import contextlib
import datetime
import itertools
import logging
import math
import queue
import sqlite3
import threading
import time
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger(__name__)

COUNTS = ("requests", "prompt_tokens", "generation_tokens", "reasoning_tokens", "rate_limited")
SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    id TEXT PRIMARY KEY, at REAL NOT NULL, tenant TEXT NOT NULL, adapter TEXT NOT NULL,
    requests INTEGER NOT NULL, prompt_tokens INTEGER NOT NULL, generation_tokens INTEGER NOT NULL,
    reasoning_tokens INTEGER NOT NULL, rate_limited INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS usage_at ON usage (at);
CREATE TABLE IF NOT EXISTS usage_adapters (id TEXT NOT NULL, name TEXT NOT NULL, PRIMARY KEY (id, name));
"""
_memory_names = itertools.count()
BUSY_S = 30.0  # how long a write waits for another writer of the file (a `loraplex usage` reading is no writer)


@dataclass(frozen=True)
class UsageRow:
    id: str  # one billed event: a prompt's engine request id, or a refusal's own id
    at: float  # unix seconds when it was answered
    tenant: str  # '' without tenants
    adapters: tuple[str, ...]  # ('',) for the base model; each adapter of a mix; () for a refusal
    requests: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    reasoning_tokens: int = 0
    rate_limited: int = 0

    @property
    def adapter(self) -> str:
        """The row's adapter label: a mix's names joined with '+'."""
        return "+".join(self.adapters)

    def as_tuple(self) -> tuple:
        return (self.id, self.at, self.tenant, self.adapter, *(getattr(self, c) for c in COUNTS))

    @classmethod
    def from_tuple(cls, values) -> "UsageRow":
        id_, at, tenant, adapter, *counts = values
        return cls(id_, at, tenant, tuple(adapter.split("+")) if adapter or counts[0] else (), *counts)


class _GroupCommit(abc.ABC):
    """Rows queued from any thread, written by one thread a batch at a time (`_write`); flush and
    `committed` wait for the batch holding everything queued before them."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()
        self.durable = True  # whether a commit outlives the process (`committed` waits for it)
        self.unsent: list[UsageRow] = []  # rows a failed write kept for the next
        self._writer = threading.Thread(target=self._write_forever, name="usage-ledger", daemon=True)
        self._writer.start()
        self.closed = False

    def record(self, row: UsageRow) -> None:
        """Queue `row` for the next commit; any thread, never waits on the disk."""
        self._queue.put(row)

    def record_many(self, rows: list[UsageRow]) -> None:
        for row in rows:
            self._queue.put(row)

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Wait until every row recorded before this call is committed; False past `timeout`."""
        if not self._writer.is_alive():
            return False
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout)

    async def committed(self) -> None:
        """Wait, without holding the event loop, until every row recorded before this call is committed."""
        if not self.durable or not self._writer.is_alive():  # nothing to wait for, or nobody to wait on
            return
        loop, done = asyncio.get_running_loop(), asyncio.Event()
        self._queue.put(_Wake(loop, done))
        await done.wait()

    def close(self) -> None:
        """Commit what is queued and stop the writer."""
        if not self.closed:
            self.closed = True
            self.flush()
            self._queue.put(None)
            self._writer.join(30)

    def _write_forever(self) -> None:
        handle = self._open()
        stopping = False
        while True:
            batch = [] if stopping else [self._queue.get()]
            while True:  # everything queued meanwhile goes into the same transaction
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            self._commit(handle, batch)
            if stopping:  # what came after the stop (a waiter racing close) is written and woken too
                self._close(handle)
                return
            stopping = any(item is None for item in batch)

    def _commit(self, handle, batch: list) -> None:
        """One batch's rows written, then its waiters woken, whatever the write did: a waiter never hangs."""
        rows = [item for item in batch if isinstance(item, UsageRow)]
        try:
            if rows or self.unsent:  # rows kept from a failed write go with the next batch, even a flush
                self._write(handle, rows)
        except Exception:  # a sink's own failures are handled in `_write`; anything else must not stop the writer
            log.exception("usage ledger: %d rows could not be written", len(rows))
        finally:
            for item in batch:
                if isinstance(item, (threading.Event, _Wake)):
                    item.set()

    def _open(self):
        return None

    @abc.abstractmethod
    def _write(self, handle, rows: list[UsageRow]) -> None:
        """Commit `rows` (in one transaction where the sink has them)."""

    def _close(self, handle) -> None:
        pass


class UsageLedger(_GroupCommit):
    """The ledger in a SQLite file (`path`), or in memory (`path` None)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.uri = f"file:{path}" if path else f"file:loraplex-ledger-{next(_memory_names)}?mode=memory&cache=shared"
        self._keep = self._connect()  # an in-memory database lives while a connection holds it
        self._keep.executescript(SCHEMA)
        # in memory (a shared cache) a reader meets table locks, not WAL's snapshots: reads and writes take turns
        self._memory_lock = threading.Lock() if not path else contextlib.nullcontext()
        super().__init__()
        self.durable = bool(path)

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.uri, uri=True, check_same_thread=False, isolation_level=None, timeout=BUSY_S)
        if self.path:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
        return db

    def close(self) -> None:
        if not self.closed:
            super().close()
            self._keep.close()

    def _open(self) -> sqlite3.Connection:
        return self._connect()

    def _close(self, db: sqlite3.Connection) -> None:
        db.close()

    def _write(self, db: sqlite3.Connection, rows: list[UsageRow]) -> None:
        """A failed write (a full disk, a locked file) keeps its rows for the next batch."""
        rows, self.unsent = self.unsent + rows, []
        try:
            self._insert(db, rows)
        except sqlite3.OperationalError:  # locked, busy, full: the file's state, not the rows'
            log.exception("usage ledger: %d rows could not be written to %s; kept in memory until a write succeeds",
                          len(rows), self.path or "memory")
            self.unsent = rows
        except Exception:  # a row SQLite refuses (a count out of range): written one by one, the bad one dropped
            for row in rows:
                try:
                    self._insert(db, [row])
                except sqlite3.OperationalError:
                    self.unsent.append(row)
                except Exception:
                    log.exception("usage ledger: row %s cannot be written; dropped", row)

    def _insert(self, db: sqlite3.Connection, rows: list[UsageRow]) -> None:
        with self._memory_lock, db:  # one transaction
            db.execute("BEGIN IMMEDIATE")
            db.executemany("INSERT OR IGNORE INTO usage VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                           [row.as_tuple() for row in rows])
            db.executemany("INSERT OR IGNORE INTO usage_adapters VALUES (?, ?)",
                           [(row.id, name) for row in rows for name in row.adapters])

    # ---- reading ----------------------------------------------------------------------------

    def usage(self, since: float | None = None, until: float | None = None) -> dict:
        """Every row with since <= at < until, summed per tenant, per adapter, in total and per UTC day."""
        self.flush()
        db = self._connect()
        try:
            window, params = _window(since, until)
            with self._memory_lock:
                by_tenant = db.execute(f"SELECT {_DAY}, tenant, {_SUMS} FROM usage u {window} GROUP BY 1, 2",
                                       params).fetchall()
                by_adapter = db.execute(f"SELECT {_DAY}, a.name, {_SUMS} FROM usage u JOIN usage_adapters a "
                                        f"ON a.id = u.id {window} GROUP BY 1, 2", params).fetchall()
        finally:
            db.close()
        return {"object": "usage", "since": since, "until": until, **_summed(by_tenant, by_adapter),
                "days": {day: _summed([r for r in by_tenant if r[0] == day], [r for r in by_adapter if r[0] == day])
                         for day in sorted({r[0] for r in by_tenant})}}

    def rows(self, since: float | None = None, until: float | None = None) -> list[UsageRow]:
        """The window's rows, oldest first (`loraplex usage --format csv` sums them per day)."""
        self.flush()
        db = self._connect()
        try:
            window, params = _window(since, until)
            with self._memory_lock:
                found = db.execute(f"SELECT * FROM usage u {window} ORDER BY at, id", params).fetchall()
        finally:
            db.close()
        return [UsageRow.from_tuple(values) for values in found]


class RemoteLedger(_GroupCommit):
    """A Ray replica's ledger: rows sent in batches to the cluster's one ledger (`send(rows)`, which
    returns once they are committed there), read back through `read(since, until)`. A batch that
    cannot be sent after `ATTEMPTS` tries is kept here and sent with the next one, so a ledger that is
    away for a while delays rows, never drops them, and never holds a request's answer for longer."""

    def __init__(self, send: Callable[[list[UsageRow]], None], read: Callable[[float | None, float | None], dict]):
        self.send, self.read = send, read
        self.away_until = 0.0  # after a batch failed, rows wait here (answers do not) until this time
        super().__init__()

    def _write(self, handle, rows: list[UsageRow]) -> None:
        rows, self.unsent = self.unsent + rows, []
        if time.monotonic() < self.away_until:  # the ledger was just found away: keep, do not hold answers
            self.unsent = rows
            return
        for attempt in range(ATTEMPTS):
            try:
                self.send(rows)
                return
            except Exception:  # the ledger's actor away (restarting, the cluster shutting down)
                log.warning("usage ledger: sending %d rows failed (try %d)", len(rows), attempt + 1, exc_info=True)
                time.sleep(RETRY_S)
        log.error("usage ledger: %d rows kept here until the cluster's ledger answers", len(rows))
        self.unsent, self.away_until = rows, time.monotonic() + AWAY_S

    def usage(self, since: float | None = None, until: float | None = None) -> dict:
        self.flush()
        return self.read(since, until)


RETRY_S = 0.5
ATTEMPTS = 2
AWAY_S = 5.0  # how long a ledger found away is not asked again


@dataclass(frozen=True)
class _Wake:
    """An event loop's waiter on the next commit."""

    loop: asyncio.AbstractEventLoop
    event: asyncio.Event

    def set(self) -> None:
        with contextlib.suppress(RuntimeError):  # its loop closed meanwhile: nobody waits
            self.loop.call_soon_threadsafe(self.event.set)


_DAY = "date(u.at, 'unixepoch')"
_SUMS = ", ".join(f"sum(u.{c})" for c in COUNTS)


def _window(since: float | None, until: float | None) -> tuple[str, list[float]]:
    conditions, params = [], []
    if since is not None:
        conditions.append("u.at >= ?")
        params.append(since)
    if until is not None:
        conditions.append("u.at < ?")
        params.append(until)
    return ("WHERE " + " AND ".join(conditions) if conditions else ""), params


def _summed(by_tenant: list[tuple], by_adapter: list[tuple]) -> dict:
    """{tenants, adapters, totals} from (day, name, *sums) rows; '' as a tenant is the callers without
    one (counted in the totals only); an adapter's rate_limited is left out (a refusal names none)."""
    tenants: dict[str, dict[str, int]] = {}
    adapters: dict[str, dict[str, int]] = {}
    totals = dict.fromkeys(COUNTS, 0)
    for _, name, *sums in by_tenant:
        _add(totals, sums)
        if name:
            _add(tenants.setdefault(name, dict.fromkeys(COUNTS, 0)), sums)
    for _, name, *sums in by_adapter:
        _add(adapters.setdefault(name, dict.fromkeys(COUNTS[:-1], 0)), sums)
    return {"tenants": tenants, "adapters": adapters, "totals": totals}


def _add(into: dict[str, int], sums) -> None:
    for key, value in zip(COUNTS, sums):
        if key in into:
            into[key] += value or 0


def parse_time(value: str | None, param: str) -> float | None:
    """`since` / `until` as given: unix seconds, or an ISO 8601 date or time (UTC unless it says)."""
    if value is None or value == "":
        return None
    if not (len(value) == 8 and value.isdigit()):  # 20260301 is a date (ISO's basic form), not seconds
        try:
            seconds = float(value)
        except ValueError:
            pass
        else:
            if not math.isfinite(seconds):
                raise ValueError(f"{param} must be a finite time, got {value!r}")
            return seconds
    try:
        moment = datetime.datetime.fromisoformat(value.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise ValueError(f"{param} must be unix seconds or an ISO 8601 date or time, got {value!r}") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.timezone.utc)
    return moment.timestamp()
