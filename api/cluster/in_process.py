"""One HTTP request through an ASGI app in-process (how a Ray replica calls its app)."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator


def _scope(request: dict) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http",
            "method": request["method"], "path": request["path"], "raw_path": request["path"].encode(),
            "root_path": "", "query_string": request["query_string"], "headers": request["headers"],
            "client": tuple(request["client"]), "server": ("127.0.0.1", 0)}


async def call_asgi(app, request: dict, body: bytes, headers: list[tuple[bytes, bytes]]) -> AsyncIterator[Any]:
    """First {"status", "headers"} (plus `headers`), then the body's chunks as the app sends
    them. Closed early (the client left), the app sees a disconnect, which aborts what the
    request started."""
    sent: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_read = False

    async def receive() -> dict:
        nonlocal body_read
        if not body_read:
            body_read = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    app_task = asyncio.ensure_future(app(_scope(request), receive, sent.put))
    app_task.add_done_callback(lambda _: sent.put_nowait(None))
    try:
        while (message := await sent.get()) is not None:
            if message["type"] == "http.response.start":
                yield {"status": message["status"], "headers": [*message.get("headers", []), *headers]}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body"):
                    break
    finally:
        gone.set()
        if not app_task.done():
            await asyncio.wait({app_task}, timeout=5)
            app_task.cancel()
