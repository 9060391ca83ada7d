"""One generation call end to end: its prompts through the engine client's one queue (timed
for the metrics, bounded by the request timeout), then one JSON response or an SSE stream."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from loraplex.api.batch.scope_keys import BATCH_LINE
from loraplex.api.tenancy import admission, auth
from loraplex.api.openai import openai_format as fmt
from loraplex.api.tenancy.callers import OPEN, Caller, caller_of
from loraplex.api.errors import APIError, as_api_error
from loraplex.api.admin.metrics import RequestTimer
from loraplex.api.tenancy.quotas import Lease
from loraplex.api.state import ServerState
from loraplex.api.openai.streaming import ClientGone, SSEResponse, sse, until_disconnect
from loraplex.platform.engine.engine_client import AdapterMix, QueueFullError, accumulate
from loraplex.platform.request import BATCH_PRIORITY, RequestOutput, SamplingParams


def given(value, default):
    """`value` unless the client left it out (0 is a value: SamplingParams refuses it)."""
    return default if value is None else value


class _Timers:
    """Each prompt's latencies and token counts (outputs are deltas: counts are added up), and the
    call's bill: each prompt whose work the engine took, with every token delivered to the client."""

    def __init__(self, state: ServerState, prompts: list[list[int]], adapter: str | AdapterMix | None,
                 tenant: str | None, request_ids: list[str]) -> None:
        self.prompts, self.request_ids = prompts, request_ids
        self.timers = [RequestTimer(state.metrics, adapter, tenant) for _ in prompts]
        self.seen: list[dict[int, int]] = [{} for _ in prompts]  # tokens out of the engine so far per choice
        self.generated: list[dict[int, int]] = [{} for _ in prompts]  # tokens delivered so far per choice
        self.reasoning = [0 for _ in prompts]  # of those, tokens delivered while the reasoning ran
        self.undecided: list[dict[int, int]] = [{} for _ in prompts]  # per choice: tokens whose text is held back
        self.reasons: list[dict[int, str | None]] = [{} for _ in prompts]
        self.queued = [False for _ in prompts]
        self.done = [False for _ in prompts]
        self.tracing = state.tracing  # each finished prompt's spans (a no-op without --otlp-traces-endpoint)
        for _ in prompts:
            state.metrics.count_request(adapter, tenant)

    def saw(self, i: int, delta: RequestOutput) -> None:
        """A delta out of the engine: latencies."""
        if delta.queue_time_s is not None and not self.queued[i]:
            self.queued[i] = True
            self.timers[i].queued(delta.queue_time_s, delta.grammar_wait_s)
        for o in delta.outputs:
            self.seen[i][o.index] = self.seen[i].get(o.index, 0) + len(o.token_ids)
        self.timers[i].tokens(max(self.seen[i].values(), default=0))

    def delivered(self, i: int, delta: RequestOutput) -> None:
        """A delta handed on to the client (sent, for a stream): its tokens are billed."""
        for o in delta.outputs:
            self.generated[i][o.index] = self.generated[i].get(o.index, 0) + len(o.token_ids)
            self.reasons[i][o.index] = o.finish_reason
            self._split_reasoning(i, o)
        if delta.finished:
            self._finish(i)

    def _split_reasoning(self, i: int, o) -> None:
        reasoning, undecided = fmt.split_reasoning(self.undecided[i].pop(o.index, 0), o)
        self.reasoning[i] += reasoning
        if undecided:
            self.undecided[i][o.index] = undecided

    def close(self) -> int:
        """Bills every prompt not finished yet (a dropped client, an abort, a timeout) with what it was
        delivered; the call's billed tokens (prompts and completions)."""
        for i in range(len(self.prompts)):
            if not self.done[i]:
                self._finish(i)
        return sum(len(p) for p in self.prompts) + sum(sum(g.values()) for g in self.generated)

    def abandon(self) -> int:
        """The engine refused the call before running it: nothing served, nothing billed."""
        for timer in self.timers:
            timer.abandon()
        return 0

    def _finish(self, i: int) -> None:
        self.done[i] = True
        reasons, generated = list(self.reasons[i].values()) or [None], sum(self.generated[i].values())
        self.timers[i].finish(self.request_ids[i], len(self.prompts[i]), reasons, generated, self.reasoning[i])
        self.tracing.finished(self.timers[i], self.request_ids[i], len(self.prompts[i]), generated, reasons)


def reserved_tokens(prompts: list[list[int]], params: list[SamplingParams]) -> int:
    """What a call may cost at most: its prompts, and max_tokens for each sequence."""
    return sum(len(p) + sp.max_tokens * sp.n for p, sp in zip(prompts, params))


async def run(state: ServerState, prompts: list[list[int]], params: list[SamplingParams],
              adapter: str | AdapterMix | None, call_id: str, caller: Caller = OPEN,
              lease: Lease | None = None, stream: bool = False) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, delta output) as any prompt's output grows, until all finish. Leaving
    early (error, disconnect, timeout) aborts whatever is still running. `lease`: the tenant's
    (api/tenancy/admission.py), its tokens reserved here and settled at the end with what was billed: a
    stream's tokens as each delta is handed to the response, a whole answer's once it is complete
    (one cut short by a timeout or a client that left sent none)."""
    request_ids = [f"{call_id}-{i}" for i in range(len(prompts))]  # the response's id, then the prompt's index
    try:
        admission.reserve(state, caller, lease, reserved_tokens(prompts, params))
        timers = _Timers(state, prompts, adapter, caller.tenant.name if caller.tenant else None, request_ids)
    except BaseException:
        end_lease(lease, 0)
        raise
    refused = False  # the engine refused the prompts before running any: nothing to bill
    try:
        outputs = state.client.generate_many([{"prompt_token_ids": p} for p in prompts], params, request_ids,
                                             adapter, caller.share)
        limit = state.config.request_timeout_s
        deadline = None if limit is None else time.monotonic() + limit
        seen, pending = False, []
        async with contextlib.aclosing(outputs):
            while True:
                try:
                    i, delta = await asyncio.wait_for(anext(outputs), _left(deadline))
                except StopAsyncIteration:
                    for i, delta in pending:  # the whole answer goes out
                        timers.delivered(i, delta)
                    await state.ledger.committed()  # billed on disk before the answer (or [DONE]) goes out
                    return
                except TimeoutError:
                    raise APIError(504, f"the request took longer than {limit:g}s (request timeout)") from None
                except Exception as exc:
                    refused = not seen
                    raise _for(caller, exc) from None
                seen = True
                timers.saw(i, delta)
                if stream:
                    timers.delivered(i, delta)
                else:
                    pending.append((i, delta))
                yield i, delta
    finally:
        end_lease(lease, timers.abandon() if refused else timers.close())


BUSY = "the server is busy; retry later"


def _for(caller: Caller, exc: Exception) -> APIError:
    """The error as the caller reads it: a tenant is not told the server's queue bound or how many
    compiles others run (what others' traffic holds), only that it is busy."""
    api = as_api_error(exc)
    if caller.tenant is not None and (isinstance(exc, QueueFullError) or "compiles are already running" in api.message):
        return APIError(429, BUSY, retry_after="1")
    return api


def at_priority(request: Request, params: list[SamplingParams]) -> list[SamplingParams]:
    """A Batch API line (api/batch) runs at the batch priority, below every interactive request; it may not
    give its own."""
    if not request.scope.get(BATCH_LINE):
        return params
    if any(p.priority != 0 for p in params):
        raise APIError(400, "priority: a batch line runs at the batch priority (below interactive requests); leave "
                            "priority out", "priority")
    return [dataclasses.replace(p, priority=BATCH_PRIORITY) for p in params]


def end_lease(lease: Lease | None, billed: int) -> None:
    if lease is not None:
        lease.use(billed)
        lease.release()


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


async def respond(state: ServerState, request: Request, body, ids: list[list[int]], params: list[SamplingParams],
                  adapter: str | AdapterMix | None, view: fmt.View, lease: Lease | None = None) -> Response:
    """The whole response as JSON, or (stream: true) SSE once the first output is in: errors
    before it (validation, unknown adapter, bad schema) are plain HTTP errors. The tenant's `lease` is
    released when the generation ends (or here, if it never started)."""
    updates = run(state, ids, at_priority(request, params), adapter, view.id, caller_of(request), lease, body.stream)
    try:
        if not body.stream:
            outputs = await until_disconnect(request, _collect(updates, len(ids)))
            return JSONResponse(view.response(outputs), headers=_unenforced_header(outputs))
        first = await until_disconnect(request, anext(updates))
    except ClientGone:
        await updates.aclose()
        end_lease(lease, 0)  # a no-op unless the client left before the generation started
        return Response(status_code=499)
    except Exception:
        await updates.aclose()
        end_lease(lease, 0)
        raise
    shown = lambda text: auth.shown(request, text)  # noqa: E731  a mid-stream error, as the caller may read it
    return SSEResponse(sse(updates, first, view, body.include_usage, shown), _unenforced_header([first[1]]))


async def _collect(updates: AsyncIterator[tuple[int, RequestOutput]], num_prompts: int) -> list[RequestOutput]:
    final: dict[int, RequestOutput] = {}
    async with contextlib.aclosing(updates) as it:
        async for i, out in it:
            final[i] = accumulate(final.get(i), out)
    return [final[i] for i in range(num_prompts)]


def _unenforced_header(outputs: list[RequestOutput]) -> dict[str, str]:
    return fmt.unenforced_header(fmt.unenforced(outputs))
