"""`loraplex serve`: the engine client and the app from the command line's flags, under uvicorn
with a connection guard (slow and stalled clients, api/connection_guard.py); SIGTERM drains (a grace
period, then "shutting down" errors) and always exits 0; SIGHUP re-reads the tenants file."""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
from typing import NoReturn

import uvicorn

from loraplex.api.connection_guard import guarded_protocol
from loraplex.api.admin.routes_tenants import reload_tenants_now
from loraplex.api.launch import engine_config, model_folder, server_config
from loraplex.api.server import build_app
from loraplex.api.settings import ServerConfig
from loraplex.api.tenancy.tenants import TenantsError
from loraplex.platform.engine.engine_client import EngineClient, build_engine_client

log = logging.getLogger(__name__)
EXIT_HOOKS_S = 5.0  # what the exit hooks get before the process leaves without them
READY_POLL_S = 0.1


def serve(args: argparse.Namespace) -> int:
    model = model_folder(args.model)
    server = server_config(args, model)
    client = build_engine_client(engine_config(args, model), server.max_waiting_requests, tuple(args.lora_modules))
    app = build_app(client, server)
    _log_where(server)
    config = uvicorn_config(app, server, log_level="info", timeout_graceful_shutdown=server.shutdown_timeout_s + 5)
    # uvicorn re-raises the signal that stopped it once it is done: a stop we asked for exits 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    signal.signal(signal.SIGHUP, lambda *_: _reload_tenants(app.state.loraplex))
    try:
        _DrainingServer(config, client, server).run()  # exits the process once drained
    finally:
        client.shutdown()
    return 1  # uvicorn stopped without starting


def _reload_tenants(state) -> None:
    """SIGHUP: the tenants file read again (without --tenants, nothing to do; a broken file is logged)."""
    if state.tenants.path:
        with contextlib.suppress(TenantsError):
            reload_tenants_now(state, "SIGHUP")


def uvicorn_config(app, server: ServerConfig, **kwargs) -> uvicorn.Config:
    """uvicorn's settings for `server`, on the guarded h11 protocol (the guard hooks the parser's
    states, so it is h11, not httptools)."""
    return uvicorn.Config(app, host=server.host, port=server.port, http=guarded_protocol(server),
                          timeout_keep_alive=server.keep_alive_timeout_s, **kwargs)


def _exit_now(code: int) -> NoReturn:
    """Leave without the interpreter's finalization. The drain is over and the engine stopped, but
    a normal exit would wait for every non-daemon thread (a compile abandoned after its timeout may
    never end) and then tear down native threads still running, which can abort the process
    (std::terminate) instead of exiting with `code`. The exit hooks still run (a compile pool kills
    its worker processes there), for a bounded time, then the logs are flushed."""
    hooks = threading.Thread(target=atexit._run_exitfuncs, name="loraplex-exit", daemon=True)
    hooks.start()
    hooks.join(EXIT_HOOKS_S)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can reach it
            pass
    os._exit(code)


def _log_where(server: ServerConfig) -> None:
    """Where it serves, and a request to paste (the key stays in the environment)."""
    auth = ' -H "Authorization: Bearer $LORAPLEX_API_KEY"' if server.api_key else ""
    log.info("serving %r at %s/v1", server.served_model_name, server.url)
    log.info("try: curl %s/v1/chat/completions -H 'Content-Type: application/json'%s -d '{\"model\": \"%s\", "
             "\"messages\": [{\"role\": \"user\", \"content\": \"Hello!\"}], \"max_tokens\": 32}'",
             server.url, auth, server.served_model_name)


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, plus: on the first SIGTERM/SIGINT, requests still running after the grace
    period are aborted with a 'shutting down' error (a last SSE event, or a 503), not cut off."""

    def __init__(self, config: uvicorn.Config, client: EngineClient, server: ServerConfig) -> None:
        super().__init__(config)
        self.client, self.grace_s, self.url = client, server.shutdown_timeout_s, server.url

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            self._announcer = asyncio.ensure_future(self._announce_ready())

    async def _announce_ready(self) -> None:
        """One line on stdout once `/ready` would answer 200 (scripts wait for it, or poll /ready)."""
        while not self.should_exit:
            health = self.client.health()
            if health.problem is None and health.warming is None:
                log.info("ready")
                print(f"loraplex: ready at {self.url}/v1", flush=True)
                return
            await asyncio.sleep(READY_POLL_S)

    async def serve(self, sockets=None) -> None:
        await super().serve(sockets)
        if self.started:
            # drained: exit here, not after the event loop's close, which would wait for its worker
            # threads (one may still be compiling a grammar, for as long as the compile timeout)
            try:
                self.client.shutdown()
            finally:
                self.config.app.state.loraplex.ledger.close()  # what was billed is committed before the exit
            _exit_now(0)

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            timer = threading.Timer(self.grace_s, self.client.fail_all, args=("the server is shutting down",))
            timer.daemon = True
            timer.start()
        super().handle_exit(sig, frame)
