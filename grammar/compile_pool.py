"""Grammar compiles in worker processes that a timeout kills.

A compile is native code that cannot be interrupted: on a thread, one past its timeout kept
burning CPU and held its slot. Here each compile runs in a worker process, at a lower CPU
priority (`os.nice`), at most `workers` at once. Workers are forked from a zygote
(grammar/compile_worker.py): a fresh interpreter started with `python -m` (never a fork of this
threaded server, and one that does not re-run the server's `__main__` as multiprocessing's spawn
would, importing torch), single-threaded, with the backends' modules imported and the first
backend built once; so a worker starts in milliseconds. A compile past its timeout is killed
with its process (SIGKILL, waited for) and a fresh worker forked in its place. A backend's first
build inside a worker does not count toward a compile's timeout: the worker says when it starts
and ends. Both processes get SIGKILL when their parent ends, so none outlives the server.

A worker killed from outside (an OOM killer) fails only the compile it held, with an error that
says so, and is replaced at once; one that died idle is found dead as it is handed its next job,
which goes to its replacement instead of failing. A killed zygote takes its workers with it
(their parent-death signal) and is started again at the next fork.

`CompilePool.submit` queues a job and returns at once; the worker's answer (or the timeout's
error) completes the job on the pool's own thread, one per worker slot.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import sendfds
from typing import Callable

from loraplex.grammar.backend import GrammarError, StructuredOutputs, WorkerGone

log = logging.getLogger(__name__)

NICE = 10  # below the engine and the event loop, which keep their share of the cores
KILL_WAIT_S = 5.0
START_LIMIT_S = 300.0  # a worker's start-up, or a backend's first build: slow, but not the spec's doing
# no thread pools in the zygote (forking it must be safe), one core's worth per worker
WORKER_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


@dataclass
class Job:
    spec: StructuredOutputs
    done: Callable[[object, BaseException | None], None]  # (result, error), called on the slot's thread


class GoneIdle(WorkerGone):
    """The worker had ended before it was handed the spec (killed while idle): the spec is not why, so the job
    goes to a fresh worker instead of failing."""


class Zygote:
    """The process workers are forked from (grammar/compile_worker.py): started once per pool,
    it has imported the backends' modules and read the tokenizer, so a worker starts at once,
    a killed one's replacement too."""

    def __init__(self, setup: tuple) -> None:
        mine, theirs = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "loraplex.grammar.compile_worker", str(theirs.fileno()), str(NICE)],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env={**os.environ, **WORKER_ENV})
        theirs.close()
        self.sock = mine
        self.control = Connection(os.dup(mine.fileno()))
        self.control.send(setup)
        self._lock = threading.Lock()
        self._started = False

    def fork(self) -> "Worker":
        with self._lock:
            try:
                if not self._started:
                    message = self.control.recv() if self.control.poll(START_LIMIT_S) else None
                    if message is None or message[0] != "ready":
                        raise WorkerGone(f"the grammar compile zygote did not start: {message!r}")
                    if message[1] != 1:
                        log.warning("the grammar compile zygote has %d threads: forking it is unsafe", message[1])
                    self._started = True
                from_child, child_out = os.pipe()
                child_in, to_child = os.pipe()
                try:
                    self.control.send("fork")
                    sendfds(self.sock, [child_in, child_out])
                    pid = self.control.recv()
                except BaseException:  # no worker: no ends of its pipes left open here either
                    os.close(from_child)
                    os.close(to_child)
                    raise
                finally:
                    os.close(child_in)
                    os.close(child_out)
            except (EOFError, OSError):
                raise WorkerGone("the grammar compile zygote ended unexpectedly") from None
        return Worker(pid, Connection(from_child, writable=False), Connection(to_child, readable=False))

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.control.close()
        self.sock.close()


class Worker:
    """One compile process (a child of the zygote) and its two pipes."""

    def __init__(self, pid: int, inbox: Connection, outbox: Connection) -> None:
        self.pid, self.inbox, self.outbox = pid, inbox, outbox
        self.ready = self.killed = False
        self._lock = threading.Lock()

    def wait(self, seconds: float):
        """The worker's next message, or None after `seconds`; WorkerGone if it ended."""
        try:
            if not self.inbox.poll(max(seconds, 0.0)):
                return None
            return self.inbox.recv()
        except (EOFError, OSError):
            raise WorkerGone("the grammar compile worker ended unexpectedly") from None

    def hand(self, spec: StructuredOutputs) -> None:
        """Send `spec`; GoneIdle if the worker has ended meanwhile. An idle worker sends nothing, so a readable
        inbox is its end of file; a send into a pipe nobody reads fails."""
        try:
            gone = self.inbox.poll(0)
            if not gone:
                self.outbox.send(spec)
        except OSError:
            gone = True
        if gone:
            raise GoneIdle(f"the grammar compile worker died before it took the {spec.kind} spec")

    def kill(self) -> None:
        with self._lock:  # the slot's thread and close() may both get here
            if self.killed:
                return
            self.killed = True
        try:
            os.kill(self.pid, signal.SIGKILL)  # the zygote reaps it
            for _ in range(int(KILL_WAIT_S / 0.01)):  # gone before the timeout's error is sent
                os.kill(self.pid, 0)
                time.sleep(0.01)
            log.warning("grammar compile worker %d still exists %gs after SIGKILL", self.pid, KILL_WAIT_S)
        except ProcessLookupError:
            pass
        self.inbox.close()
        self.outbox.close()


class CompilePool:
    def __init__(self, setup: tuple, workers: int, timeout_s: float) -> None:
        self.setup, self.workers, self.timeout_s = setup, workers, timeout_s
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._slots: list[threading.Thread] = []
        self._procs: dict[int, Worker | None] = {}  # by slot: what close() must kill
        self._zygote: Zygote | None = None
        self._lock = threading.Lock()
        self.closed = False
        self.num_compiles = 0  # jobs a worker finished or was killed on (for tests and metrics)
        self.num_killed = 0
        atexit.register(_close_if_alive, weakref.ref(self))

    def submit(self, job: Job) -> None:
        with self._lock:
            if self.closed:
                raise GrammarError("the grammar compile pool is shut down")
            self._start_slots()
            self._jobs.put(job)

    def warm_up(self) -> None:
        """Start the zygote and every worker now rather than at the first compile (a server does,
        so that it is ready when it says so)."""
        with self._lock:
            if not self.closed:
                self._start_slots()

    @property
    def warm(self) -> bool:
        """Whether every slot has its worker (forked from a zygote that has imported the backends)."""
        return len(self._procs) == self.workers and all(w is not None for w in self._procs.values())

    def _start_slots(self) -> None:
        while len(self._slots) < self.workers:  # all at once: a burst finds them started
            slot = threading.Thread(target=self._serve, args=(len(self._slots),), daemon=True,
                                    name=f"loraplex-grammar-{len(self._slots)}")
            self._slots.append(slot)
            slot.start()

    def _serve(self, slot: int) -> None:
        worker = self._procs[slot] = self._fork()
        while True:
            job = self._jobs.get()
            if job is None or self.closed:
                break
            for _ in range(2):  # a worker found dead before it took the spec: once more, on its replacement
                worker, result, error = self._attempt(slot, worker, job.spec)
                if not isinstance(error, GoneIdle):
                    break
            self.num_compiles += 1
            if isinstance(error, TimeoutError):
                error = GrammarError(str(error))
            job.done(result, error)
        if worker is not None:
            worker.kill()

    def _attempt(self, slot: int, worker: Worker | None, spec: StructuredOutputs):
        """`spec` compiled on the slot's worker: (the slot's worker after it, result, error). A worker that
        ended, timed out or never started is killed and replaced at once."""
        try:
            if worker is None:
                worker = self._procs[slot] = self._fork()
            return worker, self._run(worker, spec), None
        except BaseException as exc:  # handed to the job's waiters
            if worker is not None and (isinstance(exc, (WorkerGone, TimeoutError)) or not worker.ready):
                if isinstance(exc, WorkerGone):
                    log.warning("grammar compile worker %d: %s; forking a fresh one", worker.pid, exc)
                worker.kill()
                self.num_killed += isinstance(exc, TimeoutError)
                worker = None if self.closed else self._fork()  # its replacement, at once
                self._procs[slot] = worker
            return worker, None, exc

    def _fork(self) -> Worker | None:
        for _ in range(2):  # a zygote found dead (killed, its workers with it) is started again, once
            try:
                with self._lock:  # started by a slot's thread, which lives as long as the pool: the
                    if self._zygote is None and not self.closed:  # zygote dies with the thread that started it
                        self._zygote = Zygote(self.setup)
                    zygote = self._zygote
                if zygote is None:
                    return None
                return zygote.fork()
            except WorkerGone:
                if self.closed:  # closed while this slot forked (a server stopped during its warm-up)
                    return None
                log.exception("no grammar compile worker")
                if not self._drop_if_dead(zygote):
                    return None
        return None

    def _drop_if_dead(self, zygote: Zygote) -> bool:
        """Forget `zygote` if it has ended (reaped), so that the next fork starts a new one; whether it had."""
        try:
            zygote.proc.wait(timeout=1)  # a failed fork: it is ending, or it is stuck (then it stays)
        except subprocess.TimeoutExpired:
            return False
        with self._lock:
            if self._zygote is zygote:
                self._zygote = None
        zygote.close()
        return True

    def _run(self, worker: Worker | None, spec: StructuredOutputs):
        if worker is None:
            raise WorkerGone("no grammar compile worker could be started; see the server log")
        if not worker.ready:
            try:
                message = worker.wait(START_LIMIT_S)
            except WorkerGone:  # before it took the spec: not the spec's doing
                raise GoneIdle("the grammar compile worker died as it started") from None
            if message is None or message[0] != "ready":
                raise WorkerGone(f"the grammar compile worker did not start: {message!r}")
            worker.ready = True
        worker.hand(spec)
        left, deadline = self.timeout_s, time.monotonic() + self.timeout_s
        while True:
            try:
                message = worker.wait(deadline - time.monotonic())
            except WorkerGone:
                raise WorkerGone(f"the grammar compile worker died while compiling the {spec.kind} spec (killed "
                                 "from outside, or out of memory)") from None
            if message is None:
                raise TimeoutError(f"{spec.kind} took longer than {self.timeout_s:g}s to compile")
            if message[0] == "building":  # the clock stops while a backend is built
                left, deadline = deadline - time.monotonic(), time.monotonic() + START_LIMIT_S
            elif message[0] == "built":
                deadline = time.monotonic() + left
            elif message[0] == "done":
                return message[1]
            else:
                raise message[1]

    def close(self) -> None:
        """Kill every worker process and let the slots end; jobs still queued fail."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        for worker in list(self._procs.values()):
            if worker is not None:
                worker.kill()
        if self._zygote is not None:
            self._zygote.close()
        for _ in self._slots:
            self._jobs.put(None)
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.done(None, GrammarError("the grammar compile pool is shut down"))


def _close_if_alive(ref) -> None:
    pool = ref()
    if pool is not None:
        pool.close()
