"""`loraplex serve`: the engine client and the app from the command line's flags, under uvicorn;
SIGTERM drains (a grace period, then "shutting down" errors, exit 0)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import threading
from pathlib import Path

import uvicorn

from loraplex.api.cli import model_folder, engine_args
from loraplex.api.flags import values
from loraplex.api.server import build_app
from loraplex.api.settings import ServerConfig
from loraplex.platform.config import EngineConfig
from loraplex.platform.engine_client import EngineClient, build_engine_client

log = logging.getLogger(__name__)


def engine_config(args: argparse.Namespace, model: str) -> EngineConfig:
    return EngineConfig(model=model, **engine_args(args))


def server_config(args: argparse.Namespace, model: str) -> ServerConfig:
    """The server flags; the served name defaults to the model folder's name."""
    config = ServerConfig(**values(ServerConfig, args))
    for root in config.adapter_roots:
        if not Path(root).is_dir():
            raise ValueError(f"--adapter-root {root!r} is not a folder")
    return dataclasses.replace(config, served_model_name=config.served_model_name or Path(model).name,
                               model_path=model)


def serve(args: argparse.Namespace) -> int:
    model = model_folder(args.model)
    server = server_config(args, model)
    client = build_engine_client(engine_config(args, model), server.max_waiting_requests, tuple(args.lora_modules))
    app = build_app(client, server)
    _log_where(server)
    config = uvicorn.Config(app, host=server.host, port=server.port, log_level="info",
                            timeout_graceful_shutdown=server.shutdown_timeout_s + 5)
    # uvicorn re-raises the signal that stopped it once it is done: a stop we asked for exits 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        _DrainingServer(config, client, server.shutdown_timeout_s).run()
    finally:
        client.shutdown()
    return 0


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

    def __init__(self, config: uvicorn.Config, client: EngineClient, grace_s: float) -> None:
        super().__init__(config)
        self.client, self.grace_s = client, grace_s

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            timer = threading.Timer(self.grace_s, self.client.fail_all, args=("the server is shutting down",))
            timer.daemon = True
            timer.start()
        super().handle_exit(sig, frame)
