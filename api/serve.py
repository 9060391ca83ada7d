"""`loraplex serve`: build the engine from the command line's flags and run the app under uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

import uvicorn

from loraplex.api.cli import engine_args
from loraplex.api.server import ServerConfig, build_app
from loraplex.platform.async_engine import AsyncEngine
from loraplex.platform.config import EngineConfig
from loraplex.platform.engine import Engine


def engine_config(args: argparse.Namespace, model: str) -> EngineConfig:
    return EngineConfig(model=model, **engine_args(args))


def server_config(args: argparse.Namespace, model: str) -> ServerConfig:
    for root in args.adapter_root:
        if not Path(root).is_dir():
            raise ValueError(f"--adapter-root {root!r} is not a folder")
    return ServerConfig(served_model_name=args.served_model_name or Path(model).name, model_path=model,
                        api_key=args.api_key or os.environ.get("LORAPLEX_API_KEY") or None,
                        admin_api_key=args.admin_api_key or os.environ.get("LORAPLEX_ADMIN_API_KEY") or None,
                        adapter_roots=tuple(args.adapter_root), enable_lora_resolver=args.enable_lora_resolver,
                        max_request_body_bytes=args.max_request_body_bytes,
                        request_timeout_s=args.request_timeout, enable_ui=not args.disable_ui)


def serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="[loraplex] %(message)s")
    model = args.model
    if model is None:
        from loraplex.platform.model_store import materialize_default_model

        model = str(materialize_default_model())
    model = str(Path(model).resolve())
    server = server_config(args, model)
    engine = Engine(engine_config(args, model))
    for name, path in args.lora_modules:
        engine.adapters.load(name, path)
    front = AsyncEngine(engine, max_waiting_requests=args.max_waiting_requests)
    app = build_app(front, server)
    url = f"http://{args.host}:{args.port}"
    auth = ' -H "Authorization: Bearer $LORAPLEX_API_KEY"' if server.api_key else ""
    print(f"[loraplex] serving {server.served_model_name!r} at {url}/v1\n"
          f"[loraplex] try: curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
          f"-d '{{\"model\": \"{server.served_model_name}\", \"messages\": "
          f"[{{\"role\": \"user\", \"content\": \"Hello!\"}}], \"max_tokens\": 32}}'", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                            timeout_graceful_shutdown=args.shutdown_timeout + 5)
    # uvicorn re-raises the signal that stopped it once it is done: a stop we asked for exits 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        _DrainingServer(config, front, args.shutdown_timeout).run()
    finally:
        front.shutdown()
    return 0


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, plus: on the first SIGTERM/SIGINT, requests still running after the grace
    period are aborted with a 'shutting down' error (a last SSE event, or a 503), not cut off."""

    def __init__(self, config: uvicorn.Config, front: AsyncEngine, grace_s: float) -> None:
        super().__init__(config)
        self.front, self.grace_s = front, grace_s

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            timer = threading.Timer(self.grace_s, self.front.fail_all, args=("the server is shutting down",))
            timer.daemon = True
            timer.start()
        super().handle_exit(sig, frame)
