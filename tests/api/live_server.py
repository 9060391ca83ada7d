"""Helpers for API tests (imported, not a conftest: a second `conftest` module would shadow
tests/conftest.py). A real server on 127.0.0.1 (uvicorn in a background thread, a free port) over the tiny model,
with two adapters loaded at start-up and an adapter root for hot-loading."""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

USER_KEY, ADMIN_KEY = "user-key-123", "admin-key-456"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "n"],
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 6},
                         "n": {"type": "integer", "minimum": 0, "maximum": 9}}}


@dataclass
class LiveServer:
    url: str
    front: object  # AsyncEngine
    root: Path  # the adapter root
    spare: list[Path]  # adapters in the root, not loaded
    uvicorn_server: object
    thread: threading.Thread

    @property
    def engine(self):
        return self.front.engine

    def stop(self) -> None:
        self.uvicorn_server.should_exit = True
        self.thread.join(30)
        self.front.shutdown()


def start_server(model_dir: Path, config, lora_modules: dict[str, Path] | None = None,
                 max_waiting_requests: int | None = None, shared=None, guarded: bool = False,
                 **engine_args) -> LiveServer:
    """`guarded`: uvicorn configured as `loraplex serve` configures it (api/serve.py: the connection
    guard's read timeout, idle cap and stall limit from `config`)."""
    import uvicorn

    from loraplex.api.server import build_app
    from loraplex.platform.engine.async_engine import AsyncEngine
    from loraplex.platform.config import EngineConfig
    from loraplex.platform.engine.llm_engine import Engine

    engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", **engine_args))
    for name, path in (lora_modules or {}).items():
        engine.adapters.load(name, str(path))
    front = AsyncEngine(engine, max_waiting_requests=max_waiting_requests)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    app = build_app(front, config, shared)
    if guarded:
        from loraplex.api.serve import uvicorn_config

        server = uvicorn.Server(uvicorn_config(app, config, log_level="warning", timeout_graceful_shutdown=5))
    else:
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.05)
    assert server.started, "server did not start"
    root = Path(config.adapter_roots[0]) if config.adapter_roots else Path(".")
    return LiveServer(f"http://127.0.0.1:{port}", front, root, [], server, thread)


@pytest.fixture(scope="module")
def live(tiny_model_dir, tiny_adapters, tmp_path_factory):
    from loraplex.api.server import ServerConfig

    root = tmp_path_factory.mktemp("adapter-root")
    spare = []
    for src in tiny_adapters[2:4]:
        spare.append(root / src.name)
        shutil.copytree(src, spare[-1])
    config = ServerConfig(served_model_name="tiny", model_path=str(tiny_model_dir), api_key=USER_KEY,
                          admin_api_key=ADMIN_KEY, adapter_roots=(str(root),), max_request_body_bytes=64 * 1024)
    server = start_server(tiny_model_dir, config, {"a0": tiny_adapters[0], "a1": tiny_adapters[1]},
                          num_kv_blocks=64, max_num_seqs=8, max_loras=2, max_cpu_loras=4)
    server.spare = spare
    yield server
    server.stop()


@pytest.fixture
def client(live):
    import openai

    return openai.OpenAI(base_url=live.url + "/v1", api_key=USER_KEY, max_retries=0, timeout=60)


def wait_idle(engine, timeout: float = 60.0) -> None:
    """The engine thread applies aborts asynchronously: wait until nothing is in flight (`timeout`: a safety net,
    left as soon as the engine is idle; what follows asserts the state, never the time it took)."""
    deadline = time.monotonic() + timeout
    while engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.02)


def http(live, path: str, body=None, key: str | None = USER_KEY, raw: bytes | None = None,
         method: str | None = None) -> tuple[int, dict | str]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(live.url + path, data=data, method=method or ("POST" if data is not None else "GET"))
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            status, text = resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        status, text = err.code, err.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def assert_error(result, status: int, fragment: str = "") -> None:
    code, body = result
    assert code == status, body
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["code"] == status
    assert fragment.lower() in body["error"]["message"].lower()
    assert "Traceback" not in body["error"]["message"]


def streamed(chunks) -> tuple[str, dict[int, list[str]], list[str]]:
    """Content, each call's [name, arguments] added up by index (the name comes once, first), and the
    finish reasons of a streamed chat completion."""
    content, calls, finishes = "", {}, []
    for chunk in chunks:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or []:
            have = calls.setdefault(part.index, ["", ""])
            if part.id:
                assert part.function.name and not have[0]
                have[0] = part.function.name
            have[1] += part.function.arguments or ""
        finishes += [chunk.choices[0].finish_reason] if chunk.choices[0].finish_reason else []
    return content, calls, finishes


class HeldSteps:
    """Installed as the engine's step (the engine thread calls it through the instance): once `count` requests run
    and each has a token out, the next step waits for `release` (or a minute, a safety net), so none can finish
    before the test has done what it does while they run."""

    def __init__(self, engine, count: int) -> None:
        self.engine, self.count, self._step = engine, count, engine.step
        self.holding, self.release = threading.Event(), threading.Event()
        engine.step = self

    def __call__(self):
        running = self.engine.core.scheduler.running
        if not self.release.is_set() and len(running) >= self.count and all(r.output_token_ids for r in running):
            self.holding.set()
            self.release.wait(60)
        return self._step()

    def remove(self) -> None:
        self.release.set()
        self.engine.step = self._step


class StepCounter:
    """Counts the engine's steps while installed (the engine thread calls `engine.step` through the instance): a
    measure of work and waiting that a busy machine does not stretch, as it stretches seconds."""

    def __init__(self, engine) -> None:
        self.engine, self.count, self._step = engine, 0, engine.step
        engine.step = self

    def __call__(self):
        self.count += 1
        return self._step()

    def remove(self) -> None:
        self.engine.step = self._step

