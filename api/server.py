"""The OpenAI-compatible HTTP server over an `EngineClient`: `build_app(client, config)` wires
the routers (one module per endpoint family), the error handlers, the body limit, relative
redirects and the web console; `loraplex serve` runs the app under uvicorn, each Ray replica calls it in-process.

Each request: parse (pydantic, api/openai/protocol.py) -> resolve `model` to base or adapter
(api/sources/adapter_directory.py) -> tokenize -> SamplingParams -> the client's `generate_many`
-> OpenAI JSON or SSE chunks (api/openai/generation.py). A client that goes away cancels its handler,
which aborts its requests (KV blocks and pins freed).
"""

from __future__ import annotations

import logging
from urllib.parse import urlsplit

from fastapi import FastAPI

import loraplex
from loraplex.api.admin import routes_adapters, routes_console, routes_tenants
from loraplex.api.batch import routes_batches, routes_files
from loraplex.api.openai import routes_chat, routes_completions, routes_models, routes_responses, routes_tokenize
from loraplex.api.tenancy import auth
from loraplex.api.sources.adapter_directory import SharedAdapters
from loraplex.api.body_limit import BodyLimit
from loraplex.api.errors import APIError, install_error_handlers
from loraplex.api.settings import ServerConfig
from loraplex.api.state import ServerState
from loraplex.platform.engine.engine_client import EngineClient

__all__ = ["APIError", "ServerConfig", "ServerState", "SharedAdapters", "app_for", "build_app"]

log = logging.getLogger(__name__)
ROUTERS = (routes_models, routes_completions, routes_chat, routes_responses, routes_tokenize, routes_adapters,
           routes_console, routes_tenants, routes_files, routes_batches)


def build_app(client: EngineClient, config: ServerConfig, shared: SharedAdapters | None = None) -> FastAPI:
    return app_for(ServerState.create(client, config, shared))


def app_for(state: ServerState) -> FastAPI:
    """The app over `state` (a Ray replica keeps the state to reach its adapters and metrics)."""
    app = FastAPI(title="loraplex", version=loraplex.__version__,
                  description="OpenAI-compatible multi-LoRA, structured-output LLM server")
    app.state.loraplex = state
    app.router.on_shutdown.append(state.tracing.shutdown)  # the spans still buffered are exported at stop
    app.add_middleware(BodyLimit, limit=state.config.max_request_body_bytes)
    app.add_middleware(RelativeRedirects)
    install_error_handlers(app, auth.shown)
    for module in ROUTERS:
        app.include_router(module.router)
    if state.config.enable_ui:
        routes_console.mount_ui(app)
    if auth.admin_off(state):
        log.warning(auth.ADMIN_OFF)
    return app


class RelativeRedirects:
    """Redirects name a path, never a host: starlette builds its own (a missing slash, /ui) from the
    request's Host header, which a client chooses."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def relative(message) -> None:
            if message["type"] == "http.response.start" and 300 <= message["status"] < 400:
                message = {**message, "headers": [(k, _path_only(v) if k.lower() == b"location" else v)
                                                  for k, v in message.get("headers", [])]}
            await send(message)

        await self.app(scope, receive, relative)


def _path_only(location: bytes) -> bytes:
    parts = urlsplit(location.decode("latin-1"))
    path = "/" + parts.path.lstrip("/")  # "//host" would name a host again
    return (path + (f"?{parts.query}" if parts.query else "") + (f"#{parts.fragment}" if parts.fragment else "")
            ).encode("latin-1")
