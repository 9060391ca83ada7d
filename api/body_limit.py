"""413 for bodies over the limit, before any work is queued (ASGI middleware). A route that bounds its own
body is exempt: an upload (POST /v1/files) is streamed to disk against `max_file_bytes`, a far larger
bound than a generation request's."""

from __future__ import annotations

from starlette.exceptions import HTTPException

from loraplex.api.errors import error_response


# (method, path) of the routes that enforce a bound of their own while they read the body
OWN_LIMITS = frozenset({("POST", "/v1/files")})


class BodyLimit:
    def __init__(self, app, limit: int, exempt: frozenset[tuple[str, str]] = OWN_LIMITS) -> None:
        self.app, self.limit, self.exempt = app, limit, exempt

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or (scope["method"], scope["path"]) in self.exempt:
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.limit:
            return await error_response(413, self.message())(scope, receive, send)
        received = 0

        async def limited_receive():  # a body sent in chunks, or longer than it declared
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:
                raise HTTPException(413, self.message())
            return message

        await self.app(scope, limited_receive, send)

    def message(self) -> str:
        return f"request body larger than {self.limit} bytes (max_request_body_bytes)"
