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
from loraplex.api.errors import APIError, as_api_error
from loraplex.api.metrics import RequestTimer
from loraplex.api.state import ServerState
from loraplex.api.streaming import ClientGone, SSEResponse, sse, until_disconnect
from loraplex.platform.engine_client import accumulate
from loraplex.platform.request import RequestOutput, SamplingParams

UNENFORCED_HEADER = "x-loraplex-unenforced-keywords"


def given(value, default):
    """`value` unless the client left it out (0 is a value: SamplingParams refuses it)."""
    return default if value is None else value


class _Timers:
    """Each prompt's latencies and token counts (outputs are deltas: counts are added up)."""

    def __init__(self, state: ServerState, prompts: list[list[int]], adapter: str | None) -> None:
        self.prompts = prompts
        self.timers = [RequestTimer(state.metrics, adapter) for _ in prompts]
        self.generated: list[dict[int, int]] = [{} for _ in prompts]  # tokens so far per choice
        self.reasons: list[dict[int, str | None]] = [{} for _ in prompts]
        for _ in prompts:
            state.metrics.count_request(adapter)

    def saw(self, i: int, delta: RequestOutput) -> None:
        for o in delta.outputs:
            self.generated[i][o.index] = self.generated[i].get(o.index, 0) + len(o.token_ids)
            self.reasons[i][o.index] = o.finish_reason
        self.timers[i].tokens(max(self.generated[i].values(), default=0))
        if delta.finished:
            self.timers[i].finish(len(self.prompts[i]), list(self.reasons[i].values()), sum(self.generated[i].values()))


async def run(state: ServerState, prompts: list[list[int]], params: list[SamplingParams], adapter: str | None,
              prefix: str) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, delta output) as any prompt's output grows, until all finish. Leaving
    early (error, disconnect, timeout) aborts whatever is still running."""
    base_id = f"{prefix}-{uuid.uuid4().hex}"
    timers = _Timers(state, prompts, adapter)
    outputs = state.client.generate_many([{"prompt_token_ids": p} for p in prompts], params,
                                         [f"{base_id}-{i}" for i in range(len(prompts))], adapter)
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


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


async def respond(state: ServerState, request: Request, body, ids: list[list[int]], params: list[SamplingParams],
                  adapter: str | None, view: fmt.View) -> Response:
    """The whole response as JSON, or (stream: true) SSE once the first output is in: errors
    before it (validation, unknown adapter, bad schema) are plain HTTP errors."""
    updates = run(state, ids, params, adapter, view.id_prefix)
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
