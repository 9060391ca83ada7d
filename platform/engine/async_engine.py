"""The engine on one background thread: submit requests, iterate their outputs, abort by id;
`AsyncEngine` is the `EngineClient` (platform/engine/engine_client.py) a server talks to.

Only the engine thread touches the engine's state; other threads talk to it through a queue
of typed commands. Each request's outputs are deltas (the text, token ids and logprobs it
gained; `output_processor.accumulate` adds them up) and arrive on its own stream, readable from
threads (`stream`) or from asyncio (`generate`) without tying up a thread per waiting request.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Iterator

from loraplex.platform.adapter_mix import AdapterMix
from loraplex.platform.device import select_device
from loraplex.platform.core.fair_share import TenantShare
from loraplex.platform.core.engine_core import EngineStats
from loraplex.platform.engine.llm_engine import Engine
from loraplex.adapters.registry import AdapterInfo, AdapterStatus
from loraplex.grammar.backend import StructuredOutputs
from loraplex.platform.engine.values import (ClientTooSlowError, EngineDeadError, Health, QueueFullError,
                                             StepFailedError, StructuredCheck)
from loraplex.platform.request import Request, RequestOutput, SamplingParams
from loraplex.platform.executor.abstract import WorkerDiedError

__all__ = ["AsyncEngine", "ClientTooSlowError", "EngineDeadError", "QueueFullError", "StepFailedError"]

_DONE = object()
MAX_CONSECUTIVE_STEP_FAILURES = 3  # then the engine is considered broken: /health 503, fail fast
log = logging.getLogger(__name__)


@dataclass
class _Add:
    request: Request


@dataclass
class _Abort:
    request_id: str


@dataclass
class _FailAll:
    reason: str


@dataclass
class _Wake:
    pass


@dataclass
class _Unread:
    """The outputs of one API call published for its reader and taken by it, and how many may be
    left unread (`max_unread_outputs` a sequence of the call). Each count has one writer (the
    engine thread, the reader), and outputs still on their way to an event loop's queue count as
    unread, which the queue's size does not."""
    limit: int
    published: int = 0
    taken: int = 0

    @property
    def count(self) -> int:
        return self.published - self.taken


class _Stream:
    """One request's outputs. The engine thread puts; a thread or an event loop reads. The
    requests of one API call may share one asyncio queue, each item tagged with its prompt."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None, unread: _Unread, items: asyncio.Queue | None = None,
                 tag: int | None = None) -> None:
        self.loop = loop
        self.items: asyncio.Queue | queue.Queue = items if items is not None else \
            asyncio.Queue() if loop else queue.Queue()
        self.tag = tag
        self.unread = unread  # shared by the streams of one queue

    def put(self, item, pending: dict | None = None) -> None:
        """`pending`: a step's deliveries, gathered per event loop (one wake-up per loop and step)."""
        if self.tag is not None:
            item = (self.tag, item)
        if self.loop is None:
            self.items.put(item)
        elif pending is not None:
            pending.setdefault(self.loop, []).append((self.items, item))
        else:
            _deliver(self.loop, [(self.items, item)])


def _deliver(loop: asyncio.AbstractEventLoop, items: list[tuple[asyncio.Queue, object]]) -> None:
    try:
        loop.call_soon_threadsafe(_put_all, items)
    except RuntimeError:  # the reader's loop is closed: nobody is listening any more
        pass


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for queue_, item in items:
        queue_.put_nowait(item)


class AsyncEngine:
    def __init__(self, engine: Engine, max_waiting_requests: int | None = None,
                 max_unread_outputs: int = 4096) -> None:
        self.engine = engine
        # the front end's own parts: prompts in, adapters by name, structured specs compiled
        self.inputs, self.adapters, self.grammars = engine.inputs, engine.adapters, engine.grammars
        self.max_waiting_requests = max_waiting_requests
        self.max_unread_outputs = max_unread_outputs  # per stream (per API call): a reader that stops reading
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._num_queued = 0  # sequences (n per request) submitted, not yet handed to the scheduler
        self._stats: EngineStats = engine.stats()
        self.closing: str | None = None  # why new requests are refused (shutting down)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="loraplex-engine", daemon=True)
        self._thread.start()

    # ---- EngineClient: tokens, structured specs, adapters, health -----------------------------
    # Each call that may take long (a long prompt, a compile, a disk read) runs in a worker
    # thread: never on the caller's event loop, never on the engine thread.

    @property
    def max_model_len(self) -> int:
        return self.inputs.limits.max_model_len

    @property
    def max_adapters_per_request(self) -> int:
        return self.inputs.limits.max_adapters_per_request

    async def tokenize(self, text: str, add_special_tokens: bool = True, adapter: str | None = None) -> list[int]:
        return await asyncio.to_thread(self.inputs.token_ids, text, add_special_tokens, adapter)

    async def tokenize_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template_kwargs: dict | None = None, tools: list[dict] | None = None,
                            adapter: str | None = None) -> list[int]:
        return await asyncio.to_thread(self.inputs.chat_token_ids, messages, add_generation_prompt,
                                       chat_template_kwargs, tools, adapter)

    async def detokenize(self, ids: list[int], param: str = "tokens", adapter: str | None = None) -> str:
        return await asyncio.to_thread(self.inputs.detokenize, ids, param, adapter)

    def default_max_tokens(self, prompt_ids: list[int]) -> int:
        return self.inputs.default_max_tokens(prompt_ids)

    async def validate_structured(self, spec: StructuredOutputs, tenant: TenantShare | None = None) -> StructuredCheck:
        compiled = await self.grammars.compiled(spec, tenant.cache_namespace if tenant is not None else "")
        return StructuredCheck(compiled.backend, tuple(compiled.unenforced))

    async def load_adapter(self, name: str, path: str, confined: bool = False) -> AdapterInfo:
        return await asyncio.to_thread(self.adapters.load, name, path, False, confined)

    def unload_adapter(self, name: str) -> None:
        self.adapters.unload(name)

    def list_adapters(self) -> list[AdapterInfo]:
        return self.adapters.list()

    def adapter_status(self) -> dict[str, AdapterStatus]:
        return self.adapters.status()

    def stats(self) -> EngineStats:
        """The snapshot the engine thread took after its last step."""
        return self._stats

    def health(self) -> Health:
        warming = None if self.engine.grammars.warm else "the grammar compile workers are starting"
        return Health(self.is_alive, self.closing, warming)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    def submit(self, prompt, params: SamplingParams, request_id: str | None = None,
               adapter: str | AdapterMix | None = None) -> str:
        """Validate (raising ValueError here, in the caller's thread) and queue a request."""
        self._check_accepting(params.n if isinstance(params, SamplingParams) else 1)
        request = self.inputs.process(request_id or f"req-{next(self._ids)}", prompt, params, adapter)
        self._enqueue(request, None)
        return request.request_id

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

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
                stream.unread.taken += 1
                yield item
        finally:
            self._streams.pop(request_id, None)

    async def generate(self, prompt, params: SamplingParams, request_id: str | None = None,
                       adapter: str | AdapterMix | None = None) -> AsyncIterator[RequestOutput]:
        """Async iterator over one request's delta outputs; leaving it early (client gone, task
        cancelled) aborts the request."""
        async with contextlib.aclosing(self.generate_many([prompt], [params], [request_id], adapter)) as outputs:
            async for _, out in outputs:
                yield out

    async def generate_many(self, prompts: list, params: list[SamplingParams], request_ids: list[str | None],
                            adapter: str | AdapterMix | None = None,
                            tenant: TenantShare | None = None) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, delta output) for several requests (one API call) through one queue,
        until all finish. Tokenizing, the adapter's disk read and the grammar compiles run in a
        worker thread, all before anything is queued (a bad prompt queues none). Leaving early
        aborts what is still running."""
        self._check_accepting(sum(sp.n for sp in params))
        ids = [rid or f"req-{next(self._ids)}" for rid in request_ids]
        requests = await asyncio.to_thread(
            lambda: [self.inputs.process(rid, p, sp, adapter, tenant, compile=False)
                     for rid, p, sp in zip(ids, prompts, params)])
        for request in requests:  # awaited here: a slow compile holds none of the loop's worker threads
            spec = self.inputs.grammar_spec(request)
            if spec is not None:
                waited = time.monotonic()
                request.compiled_grammar = await self.grammars.compiled(
                    spec, tenant.cache_namespace if tenant is not None else "")
                request.grammar_wait_s = (waited - request.arrival_time, time.monotonic() - request.arrival_time)
                self.inputs.check_budget(request)
        items: asyncio.Queue = asyncio.Queue()
        loop, unread = asyncio.get_running_loop(), _Unread(self.max_unread_outputs * sum(sp.n for sp in params))
        remaining: set[int] = set()
        try:
            for i, request in enumerate(requests):
                self._enqueue(request, loop, items, i, unread)
                remaining.add(i)
            while remaining:
                i, item = await items.get()
                if item is _DONE:
                    remaining.discard(i)
                elif isinstance(item, BaseException):
                    remaining.discard(i)
                    raise item
                else:
                    unread.taken += 1
                    yield i, item
        finally:
            for i in remaining:
                self.abort(ids[i])
            for rid in ids:
                self._streams.pop(rid, None)

    def fail_all(self, reason: str) -> None:
        """Stop taking requests; abort every request in flight, each stream ending with `reason`."""
        self.closing = reason
        self._commands.put(_FailAll(reason))

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(_Wake())
        self._thread.join(timeout)
        self.engine.close()

    def _check_accepting(self, incoming: int = 1) -> None:
        """Refuse when shutting down, dead, or when `incoming` more sequences (every prompt and
        every n of a call count) would pass max_waiting_requests."""
        if self.closing is not None:
            raise EngineDeadError(self.closing)
        if not self.is_alive:
            raise EngineDeadError("the engine failed; see the server log")
        limit = self.max_waiting_requests
        if limit is not None and self._num_queued + self._stats.num_waiting_seqs + incoming > limit:
            raise QueueFullError(f"{limit} requests are already waiting (max_waiting_requests); retry later")

    def _enqueue(self, request: Request, loop: asyncio.AbstractEventLoop | None, items: asyncio.Queue | None = None,
                 tag: int | None = None, unread: _Unread | None = None) -> _Stream:
        if request.request_id in self._streams:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if unread is None:  # a call of one request
            unread = _Unread(self.max_unread_outputs * request.params.n)
        stream = self._streams[request.request_id] = _Stream(loop, unread, items, tag)
        with self._lock:
            self._num_queued += request.params.n
        self._commands.put(_Add(request))
        if self.error is not None:  # the engine died while this request compiled: its loop reads no more
            stream.put(EngineDeadError("the engine failed; see the server log"))
        return stream

    # ---- engine thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        failures = 0
        try:
            select_device(self.engine.device)  # CUDA's current device is per thread: this one runs the steps
            while not self._stop.is_set():
                self._drain_commands(block=not self.engine.has_unfinished())
                if self.engine.has_unfinished():
                    failures = self._step(failures)
                self._stats = self.engine.stats()
        except BaseException as exc:  # the engine cannot continue: fail every stream, never hang
            log.exception("the engine failed and stopped")
            self.error = exc
            for stream in list(self._streams.values()):
                stream.put(EngineDeadError("the engine failed; see the server log"))
            for request_id in self.engine.unfinished_request_ids():  # their KV blocks and adapter pins freed
                with contextlib.suppress(Exception):
                    self.engine.abort(request_id)

    def _step(self, failures: int) -> int:
        """One engine step, its outputs published; back: consecutive failed steps. A failed step
        aborts its batch; too many in a row and the engine is broken (raises)."""
        try:
            outputs = self.engine.step()
        except WorkerDiedError:  # a tensor-parallel worker is gone: no later step can run
            raise
        except Exception:
            if failures + 1 >= MAX_CONSECUTIVE_STEP_FAILURES:
                raise
            log.exception("engine step failed; aborting the requests in its batch")
            for request_id in self.engine.abort_running():
                self._fail(request_id, StepFailedError("generation failed with an internal error; see the server log"))
            return failures + 1
        pending: dict = {}  # a loop wakes once a step for all its streams' outputs, not once per output
        for out in outputs:
            self._publish(out, pending)
        for loop, items in pending.items():
            _deliver(loop, items)
        return 0

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.1) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command) -> None:
        if isinstance(command, _Add):
            self._add(command.request)
        elif isinstance(command, _Abort):
            out = self.engine.abort(command.request_id)
            if out is not None:
                self._publish(out)
        elif isinstance(command, _FailAll):
            for request_id in self.engine.unfinished_request_ids():
                self.engine.abort(request_id)
                self._fail(request_id, EngineDeadError(command.reason))

    def _add(self, request: Request) -> None:
        with self._lock:
            self._num_queued -= request.params.n
        try:
            if self.closing is not None:
                raise EngineDeadError(self.closing)
            self.engine.add(request)
        except (ValueError, EngineDeadError) as exc:  # an id in use, an adapter unloaded meanwhile
            self._fail(request.request_id, exc)

    def _fail(self, request_id: str, exc: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put(exc)

    def _publish(self, out: RequestOutput, pending: dict | None = None) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        if not out.finished and stream.unread.count >= stream.unread.limit:
            # a client that stopped reading (but did not disconnect) must not grow memory forever
            self.engine.abort(out.request_id)
            stream.put(ClientTooSlowError(f"more than {stream.unread.limit} outputs were left unread; "
                                          f"the request was aborted"), pending)
            return
        stream.unread.published += 1
        stream.put(out, pending)
        if out.finished:
            stream.put(_DONE, pending)
