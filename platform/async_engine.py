"""The engine on one background thread: submit requests, iterate their outputs, abort by id.

Only the engine thread touches the engine's state; other threads talk to it through a command
queue. Each request's outputs (cumulative: text and token ids so far) arrive on its own queue,
readable from threads (`stream`) or from asyncio (`generate`).
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from typing import AsyncIterator, Iterator

from loraplex.platform.engine import Engine
from loraplex.platform.request import RequestOutput, SamplingParams

_DONE = object()


class EngineDeadError(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, queue.Queue] = {}
        self._ids = itertools.count()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="loraplex-engine", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def submit(self, prompt, params: SamplingParams, request_id: str | None = None,
               adapter: str | None = None) -> str:
        """Validate (raising ValueError here, in the caller's thread) and queue a request."""
        if not self.is_alive:
            raise EngineDeadError(f"the engine is not running: {self.error!r}")
        request_id = request_id or f"req-{next(self._ids)}"
        request = self.engine.make_request(request_id, prompt, params, adapter)
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self._streams[request_id] = queue.Queue()
        self._commands.put(("add", request))
        return request_id

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def stream(self, request_id: str, timeout: float | None = None) -> Iterator[RequestOutput]:
        """Blocking iterator over one request's outputs; the last one has finished=True."""
        q = self._streams[request_id]
        try:
            while True:
                item = q.get(timeout=timeout)
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self._streams.pop(request_id, None)

    async def generate(self, prompt, params: SamplingParams, request_id: str | None = None,
                       adapter: str | None = None) -> AsyncIterator[RequestOutput]:
        """Async iterator; leaving it early (client gone, task cancelled) aborts the request."""
        request_id = self.submit(prompt, params, request_id, adapter)
        q = self._streams[request_id]
        finished = False
        try:
            while True:
                item = await asyncio.to_thread(q.get)
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

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(("wake", None))
        self._thread.join(timeout)

    # ---- engine thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_commands(block=not self.engine.has_unfinished())
                if self.engine.has_unfinished():
                    for out in self.engine.step():
                        self._publish(out)
        except BaseException as exc:  # the engine cannot continue: fail every stream, never hang
            self.error = exc
            for q in list(self._streams.values()):
                q.put(EngineDeadError(f"engine failed: {exc!r}"))

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.1) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, arg = command
            if kind == "add":
                try:
                    self.engine.add(arg)
                except ValueError as exc:  # e.g. an id still in use by an abort not yet applied
                    q = self._streams.get(arg.request_id)
                    if q is not None:
                        q.put(exc)
            elif kind == "abort":
                out = self.engine.abort(arg)
                if out is not None:
                    self._publish(out)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _publish(self, out: RequestOutput) -> None:
        q = self._streams.get(out.request_id)
        if q is None:
            return
        q.put(out)
        if out.finished:
            q.put(_DONE)
