"""The engine on one background thread: submit requests, iterate their outputs, abort by id.

Only the engine thread touches the engine's state; other threads talk to it through a command
queue. Each request's outputs (cumulative: text and token ids so far) arrive on its own stream,
readable from threads (`stream`) or from asyncio (`generate`) without tying up a thread per
waiting request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from typing import AsyncIterator, Iterator

from loraplex.platform.engine import Engine, EngineStats
from loraplex.platform.request import Request, RequestOutput, SamplingParams

_DONE = object()
MAX_CONSECUTIVE_STEP_FAILURES = 3  # then the engine is considered broken: /health 503, fail fast
log = logging.getLogger("loraplex.engine")


class EngineDeadError(RuntimeError):
    pass


class StepFailedError(RuntimeError):
    """An engine step raised; the requests in its batch were aborted, the engine goes on."""


class QueueFullError(RuntimeError):
    """More requests are waiting than `max_waiting_requests`; the caller should retry later."""


class _Stream:
    """One request's outputs. The engine thread puts; a thread or an event loop reads."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self.loop = loop
        self.items: asyncio.Queue | queue.Queue = asyncio.Queue() if loop else queue.Queue()

    def put(self, item) -> None:
        if self.loop is None:
            self.items.put(item)
            return
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, item)
        except RuntimeError:  # the reader's loop is closed: nobody is listening any more
            pass


class AsyncEngine:
    def __init__(self, engine: Engine, max_waiting_requests: int | None = None) -> None:
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._num_queued = 0  # submitted, not yet handed to the scheduler
        self.stats: EngineStats = engine.stats()
        self.closing: str | None = None  # why new requests are refused (shutting down)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="loraplex-engine", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    def submit(self, prompt, params: SamplingParams, request_id: str | None = None,
               adapter: str | None = None) -> str:
        """Validate (raising ValueError here, in the caller's thread) and queue a request."""
        self._check_accepting()
        request = self.engine.make_request(request_id or f"req-{next(self._ids)}", prompt, params, adapter)
        self._enqueue(request, None)
        return request.request_id

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def stream(self, request_id: str, timeout: float | None = None) -> Iterator[RequestOutput]:
        """Blocking iterator over one request's outputs; the last one has finished=True."""
        stream = self._streams[request_id]
        try:
            while True:
                item = stream.items.get(timeout=timeout)
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self._streams.pop(request_id, None)

    async def generate(self, prompt, params: SamplingParams, request_id: str | None = None,
                       adapter: str | None = None) -> AsyncIterator[RequestOutput]:
        """Async iterator; leaving it early (client gone, task cancelled) aborts the request.
        Tokenizing, the adapter's disk read and the grammar compile run in a worker thread."""
        self._check_accepting()
        request_id = request_id or f"req-{next(self._ids)}"
        request = await asyncio.to_thread(self.engine.make_request, request_id, prompt, params, adapter)
        stream = self._enqueue(request, asyncio.get_running_loop())
        finished = False
        try:
            while True:
                item = await stream.items.get()
                if item is _DONE:
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def fail_all(self, reason: str) -> None:
        """Stop taking requests; abort every request in flight, each stream ending with `reason`."""
        self.closing = reason
        self._commands.put(("fail_all", reason))

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(("wake", None))
        self._thread.join(timeout)

    def _check_accepting(self) -> None:
        if self.closing is not None:
            raise EngineDeadError(self.closing)
        if not self.is_alive:
            raise EngineDeadError("the engine failed; see the server log")
        limit = self.max_waiting_requests
        if limit is not None and self._num_queued + self.stats.num_waiting >= limit:
            raise QueueFullError(f"{limit} requests are already waiting (max_waiting_requests); retry later")

    def _enqueue(self, request: Request, loop: asyncio.AbstractEventLoop | None) -> _Stream:
        if request.request_id in self._streams:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        stream = self._streams[request.request_id] = _Stream(loop)
        with self._lock:
            self._num_queued += 1
        self._commands.put(("add", request))
        return stream

    # ---- engine thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        failures = 0
        try:
            while not self._stop.is_set():
                self._drain_commands(block=not self.engine.has_unfinished())
                if self.engine.has_unfinished():
                    try:
                        outputs = self.engine.step()
                        failures = 0
                    except Exception:
                        failures += 1
                        if failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                            raise
                        log.exception("engine step failed; aborting the requests in its batch")
                        outputs = []
                        for request_id in self.engine.abort_running():
                            stream = self._streams.get(request_id)
                            if stream is not None:
                                stream.put(StepFailedError("generation failed with an internal error; "
                                                           "see the server log"))
                    for out in outputs:
                        self._publish(out)
                self.stats = self.engine.stats()
        except BaseException as exc:  # the engine cannot continue: fail every stream, never hang
            log.exception("the engine failed and stopped")
            self.error = exc
            for stream in list(self._streams.values()):
                stream.put(EngineDeadError("the engine failed; see the server log"))

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.1) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, arg = command
            if kind == "add":
                with self._lock:
                    self._num_queued -= 1
                try:
                    if self.closing is not None:
                        raise EngineDeadError(self.closing)
                    self.engine.add(arg)
                except (ValueError, EngineDeadError) as exc:  # an id in use, an adapter unloaded meanwhile
                    stream = self._streams.get(arg.request_id)
                    if stream is not None:
                        stream.put(exc)
            elif kind == "abort":
                out = self.engine.abort(arg)
                if out is not None:
                    self._publish(out)
            elif kind == "fail_all":
                for request_id in list(self.engine.groups):
                    self.engine.abort(request_id)
                    stream = self._streams.get(request_id)
                    if stream is not None:
                        stream.put(EngineDeadError(arg))
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _publish(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        stream.put(out)
        if out.finished:
            stream.put(_DONE)
