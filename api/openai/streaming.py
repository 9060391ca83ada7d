"""Delivering a generation: SSE chunks as deltas come (an error mid-stream becomes a last
`data: {"error": ...}`), and a client that leaves cancels the work behind its response, which
aborts its requests (KV blocks and adapter pins freed)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Callable

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse

from loraplex.api.openai import openai_format as fmt
from loraplex.api.errors import as_api_error
from loraplex.platform.request import RequestOutput


class ClientGone(Exception):
    pass


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, awaitable):
    """Await `awaitable`, cancelling it (and so aborting its requests) if the client leaves."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    raise ClientGone()


class SSEResponse(StreamingResponse):
    """Streams until done or until the client leaves; either way the body iterator is closed at
    once, which aborts the requests behind it."""

    def __init__(self, chunks: AsyncIterator[str], headers: dict[str, str]) -> None:
        super().__init__(chunks, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})

    async def __call__(self, scope, receive, send) -> None:
        async with anyio.create_task_group() as tg:
            async def watch() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            try:
                await super().__call__(scope, receive, send)
            except OSError:  # the client went away mid-send
                pass
            finally:
                with anyio.CancelScope(shield=True):
                    await self.body_iterator.aclose()
                tg.cancel_scope.cancel()


async def sse(updates: AsyncIterator[tuple[int, RequestOutput]], first: tuple[int, RequestOutput],
              view: fmt.View, include_usage: bool,
              shown: Callable[[str], str] = lambda text: text) -> AsyncIterator[str]:
    """`shown`: an error's message as the caller may read it (the server's folders hidden)."""
    stream = view.stream(include_usage)
    try:
        for chunk in stream.chunks(*first):
            yield fmt.sse(chunk)
        async for i, out in updates:
            for chunk in stream.chunks(i, out):
                yield fmt.sse(chunk)
        if include_usage:
            yield fmt.sse(stream.usage_chunk())
    except Exception as exc:  # mid-stream: the status line is gone, so the error goes in the stream
        api = as_api_error(exc)
        yield fmt.sse(fmt.error_body(api.status, shown(api.message), api.param))
    finally:
        await updates.aclose()
    yield "data: [DONE]\n\n"
