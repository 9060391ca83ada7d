"""One generation call end to end: its prompts through the engine client's one queue (timed
for the metrics, bounded by the request timeout), then one JSON response or an SSE stream."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from loraplex.api import openai_format as fmt
from loraplex.api.callers import OPEN, Caller, caller_of
from loraplex.api.errors import APIError, as_api_error
from loraplex.api.metrics import RequestTimer
from loraplex.api.quotas import Lease, RateLimited
from loraplex.api.state import ServerState
from loraplex.api.streaming import ClientGone, SSEResponse, sse, until_disconnect
from loraplex.platform.engine_client import AdapterMix, accumulate
from loraplex.platform.request import RequestOutput, SamplingParams

UNENFORCED_HEADER = "x-loraplex-unenforced-keywords"


def given(value, default):
    """`value` unless the client left it out (0 is a value: SamplingParams refuses it)."""
    return default if value is None else value


class _Timers:
    """Each prompt's latencies and token counts (outputs are deltas: counts are added up), and the
    tenant's tokens charged as they come."""

    def __init__(self, state: ServerState, prompts: list[list[int]], adapter: str | AdapterMix | None,
                 tenant: str | None, lease: Lease | None) -> None:
        self.prompts, self.lease = prompts, lease
        self.timers = [RequestTimer(state.metrics, adapter, tenant) for _ in prompts]
        self.generated: list[dict[int, int]] = [{} for _ in prompts]  # tokens so far per choice
        self.reasons: list[dict[int, str | None]] = [{} for _ in prompts]
        self.queued = [False for _ in prompts]
        for _ in prompts:
            state.metrics.count_request(adapter, tenant)

    def saw(self, i: int, delta: RequestOutput) -> None:
        new = 0
        for o in delta.outputs:
            self.generated[i][o.index] = self.generated[i].get(o.index, 0) + len(o.token_ids)
            self.reasons[i][o.index] = o.finish_reason
            new += len(o.token_ids)
        if self.lease is not None and new:
            self.lease.charge(new)
        if delta.queue_time_s is not None and not self.queued[i]:
            self.queued[i] = True
            self.timers[i].queued(delta.queue_time_s)
        self.timers[i].tokens(max(self.generated[i].values(), default=0))
        if delta.finished:
            self.timers[i].finish(len(self.prompts[i]), list(self.reasons[i].values()), sum(self.generated[i].values()))


def _admit(state: ServerState, caller: Caller, prompts: list[list[int]], params: list[SamplingParams]) -> Lease | None:
    """A tenant's lease for this call (its prompts charged), or a 429 saying which limit and when to retry."""
    if caller.tenant is None:
        return None
    try:
        return state.limits.admit(caller.tenant, sum(len(p) * sp.n for p, sp in zip(prompts, params)))
    except RateLimited as refused:
        state.metrics.count_rate_limited(caller.tenant.name, refused.limit)
        state.audit.write("rate_limited", tenant=caller.tenant.name, limit=refused.limit, why=str(refused))
        raise APIError(429, str(refused), retry_after=refused.retry_after) from None


async def run(state: ServerState, prompts: list[list[int]], params: list[SamplingParams],
              adapter: str | AdapterMix | None, prefix: str,
              caller: Caller = OPEN) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, delta output) as any prompt's output grows, until all finish. Leaving
    early (error, disconnect, timeout) aborts whatever is still running."""
    base_id = f"{prefix}-{uuid.uuid4().hex}"
    lease = _admit(state, caller, prompts, params)
    try:
        timers = _Timers(state, prompts, adapter, caller.tenant.name if caller.tenant else None, lease)
        outputs = state.client.generate_many([{"prompt_token_ids": p} for p in prompts], params,
                                             [f"{base_id}-{i}" for i in range(len(prompts))], adapter, caller.share)
        limit = state.config.request_timeout_s
        deadline = None if limit is None else time.monotonic() + limit
        async with contextlib.aclosing(outputs):
            while True:
                try:
                    i, delta = await asyncio.wait_for(anext(outputs), _left(deadline))
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    raise APIError(504, f"the request took longer than {limit:g}s (request timeout)") from None
                except Exception as exc:
                    raise as_api_error(exc) from None
                timers.saw(i, delta)
                yield i, delta
    finally:
        if lease is not None:
            lease.release()


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


async def respond(state: ServerState, request: Request, body, ids: list[list[int]], params: list[SamplingParams],
                  adapter: str | AdapterMix | None, view: fmt.View) -> Response:
    """The whole response as JSON, or (stream: true) SSE once the first output is in: errors
    before it (validation, unknown adapter, bad schema) are plain HTTP errors."""
    updates = run(state, ids, params, adapter, view.id_prefix, caller_of(request))
    try:
        if not body.stream:
            outputs = await until_disconnect(request, _collect(updates, len(ids)))
            return JSONResponse(view.response(outputs), headers=_unenforced_header(outputs))
        first = await until_disconnect(request, anext(updates))
    except ClientGone:
        return Response(status_code=499)
    except Exception:
        await updates.aclose()
        raise
    return SSEResponse(sse(updates, first, view, body.include_usage), _unenforced_header([first[1]]))


async def _collect(updates: AsyncIterator[tuple[int, RequestOutput]], num_prompts: int) -> list[RequestOutput]:
    final: dict[int, RequestOutput] = {}
    async with contextlib.aclosing(updates) as it:
        async for i, out in it:
            final[i] = accumulate(final.get(i), out)
    return [final[i] for i in range(num_prompts)]


def _unenforced_header(outputs: list[RequestOutput]) -> dict[str, str]:
    """strict: false: the schema keywords its grammar dropped, also in the body's
    `unenforced_keywords`."""
    unenforced = fmt.unenforced(outputs)
    return {UNENFORCED_HEADER: "; ".join(unenforced)} if unenforced else {}
