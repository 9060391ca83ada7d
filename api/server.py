"""The OpenAI-compatible HTTP server over `AsyncEngine`: routes, auth, errors, SSE streaming.

`build_app(engine, config)` returns the FastAPI app; `loraplex serve` runs it under uvicorn.
Each request: parse (pydantic) -> resolve `model` to base or adapter -> tokenize -> SamplingParams
-> `AsyncEngine.generate` (validation in a worker thread) -> OpenAI JSON or SSE chunks. A client
that goes away cancels its handler, which aborts its requests (KV blocks and pins freed).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Protocol

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException

import loraplex
from loraplex.adapters.registry import AdapterInfo, AdapterInUseError, UnknownAdapterError
from loraplex.api import openai_format as fmt
from loraplex.api.metrics import RequestTimer, ServerMetrics
from loraplex.api.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ValidateSchemaRequest,
                                   LoadAdapterRequest, TokenizeRequest, UnloadAdapterRequest, chat_dicts)
from loraplex.platform.async_engine import (AsyncEngine, ClientTooSlowError, EngineDeadError, QueueFullError,
                                            StepFailedError)
from loraplex.platform.output_processor import accumulate
from loraplex.platform.request import RequestOutput, SamplingParams

log = logging.getLogger("loraplex.api")


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str
    model_path: str = ""
    api_key: str | None = None
    admin_api_key: str | None = None
    adapter_roots: tuple[str, ...] = ()  # runtime loading only from inside these; none: loading is off
    enable_lora_resolver: bool = False  # an unknown adapter name loads <root>/<name> on first use
    max_request_body_bytes: int = 4 << 20
    request_timeout_s: float | None = None
    enable_ui: bool = True  # the web console at /ui (static files; it calls this API with the user's key)


class SharedAdapters(Protocol):
    """Adapter names shared by several servers (Ray Serve replicas, `api/ray_serve.py`): each
    server serves every name here, reading it on first use, and the admin endpoints change
    the shared set. Without one, a server's adapters are its own registry's."""

    async def get(self, name: str) -> AdapterInfo | None: ...

    async def list(self) -> list[AdapterInfo]: ...

    async def register(self, info: AdapterInfo) -> bool: ...  # False: the name is taken

    async def unregister(self, name: str) -> bool: ...  # False: no such name


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


UNENFORCED_HEADER = "x-loraplex-unenforced-keywords"
UI_DIR = Path(__file__).resolve().parent / "ui"


def _error(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(fmt.error_body(status, message, param), status_code=status, headers=headers)


def _as_api_error(exc: BaseException) -> APIError:
    """What each engine-side failure means to a client."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, UnknownAdapterError):
        return APIError(404, str(exc), "model")
    if isinstance(exc, AdapterInUseError):
        return APIError(409, str(exc))
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc))
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc))
    if isinstance(exc, StepFailedError):
        return APIError(500, str(exc))
    if isinstance(exc, ClientTooSlowError):
        return APIError(408, str(exc))
    if isinstance(exc, ValueError):  # also GrammarError and AdapterError: the request's own fault
        return APIError(400, str(exc))
    log.exception("unexpected error", exc_info=exc)
    return APIError(500, "internal server error; see the server log")


def _tokens_json(count: int, max_model_len: int, ids: list[int]) -> str:
    """/tokenize's body, encoded in a worker thread and in chunks: a megabyte prompt's ids are
    megabytes of JSON, and one C call encoding them all would hold the GIL (and so the event
    loop: /health, every stream) for its whole run."""
    chunks = [",".join(map(str, ids[i:i + 65536])) for i in range(0, len(ids), 65536)]
    return f'{{"count": {count}, "max_model_len": {max_model_len}, "tokens": [{",".join(chunks)}]}}'


def _same_key(given: str, key: str) -> bool:
    """Constant-time comparison of bytes: a header with non-ASCII characters is just a wrong key
    (comparing such strings directly raises)."""
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), key.encode("utf-8", "surrogateescape"))


class _ClientGone(Exception):
    pass


class _Server:
    def __init__(self, engine: AsyncEngine, config: ServerConfig, shared: SharedAdapters | None) -> None:
        self.engine = engine
        self.config = config
        self.shared = shared
        self.inputs = engine.inputs
        self.max_model_len = engine.inputs.limits.max_model_len
        self.metrics = ServerMetrics(lambda: engine.stats)
        self.created = int(time.time())
        self._resolving: dict[str, asyncio.Future] = {}  # adapter name -> its one load in flight

    # ---- auth ------------------------------------------------------------------------------

    @staticmethod
    def _token(request: Request) -> str | None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return token.strip() if scheme.lower() == "bearer" and token.strip() else None

    def require_user(self, request: Request) -> None:
        keys = [k for k in (self.config.api_key, self.config.admin_api_key) if k]
        if not self.config.api_key:
            return
        token = self._token(request)
        if token is None or not any(_same_key(token, k) for k in keys):
            raise APIError(401, "missing or invalid API key (Authorization: Bearer <key>)")

    def require_admin(self, request: Request) -> None:
        admin = self.config.admin_api_key
        if not admin:
            return self.require_user(request)
        token = self._token(request)
        if token is not None and _same_key(token, admin):
            return
        if token is not None and self.config.api_key and _same_key(token, self.config.api_key):
            raise APIError(403, "this endpoint needs the admin API key")
        raise APIError(401, "missing or invalid admin API key (Authorization: Bearer <key>)")

    # ---- models and adapters ---------------------------------------------------------------

    async def resolve_model(self, model: str) -> str | None:
        """The adapter a `model` field names: None for the base model. Never a silent fallback.
        A shared name (replicas) not read here yet, or with the resolver on an unregistered name
        that is a PEFT folder directly inside an adapter root, is loaded first (off the event
        loop and the engine thread; concurrent first requests share one load)."""
        base = self.config.served_model_name
        if model == base:
            return None
        name = model[len(base) + 1:] if model.startswith(base + ":") else model
        missing = APIError(404, f"The model `{model}` does not exist.", "model")
        here = bool(name) and name in {a.name for a in self.engine.adapters.list()}
        if self.shared is not None and name:  # the shared set decides, also for a copy still held here
            shared = await self.shared.get(name)
            if shared is None:
                raise missing
            if here:
                return name
            path, confined = (self.adapter_path(shared.path), True) if shared.confined else (Path(shared.path), False)
        elif here:
            return name
        else:
            path, confined = self._resolvable(name) if self.config.enable_lora_resolver and name else None, True
        if path is None:
            raise missing
        await self._load_once(name, path, confined)
        return name

    async def _load_once(self, name: str, path: Path, confined: bool) -> None:
        adapters = self.engine.adapters
        load = self._resolving.get(name)
        if load is None:
            load = asyncio.ensure_future(asyncio.to_thread(adapters.load, name, str(path), False, confined))
            self._resolving[name] = load
            load.add_done_callback(lambda _: self._resolving.pop(name, None))
            log.info("loading adapter %r from %s on first use", name, path)
        try:
            await asyncio.shield(load)
        except ValueError as exc:
            if name not in {a.name for a in adapters.list()}:  # not loaded by anyone meanwhile
                raise APIError(400, f"adapter {name!r} could not be loaded: {exc}", "model") from None

    async def adapter_infos(self) -> list[AdapterInfo]:
        """The adapters this server answers for: the shared set's, else its own."""
        return await self.shared.list() if self.shared is not None else self.engine.adapters.list()

    def _resolvable(self, name: str) -> Path | None:
        """<root>/<name> when it is a PEFT folder inside its root (after symlinks), else None."""
        if name in (".", "..") or any(sep in name for sep in "/\\:\0"):
            return None
        for root in (Path(r).resolve() for r in self.config.adapter_roots):
            try:
                path = (root / name).resolve()
                if path.is_relative_to(root) and (path / "adapter_config.json").is_file() \
                        and all(f.resolve().is_relative_to(root) for f in path.iterdir()):
                    return path
            except (OSError, RuntimeError):  # a link loop, a name too long: not an adapter
                continue
        return None

    def adapter_path(self, lora_path: str) -> Path:
        """The folder `lora_path` names, after symlinks, inside one of the adapter roots. The
        registry then reads that resolved path without following any link (a link swapped in
        after this check makes the read fail, never go outside)."""
        try:
            return self._adapter_path(lora_path)
        except (OSError, RuntimeError) as exc:  # a link loop, a name too long
            raise APIError(400, f"lora_path cannot be used: {type(exc).__name__}", "lora_path") from None

    def _adapter_path(self, lora_path: str) -> Path:
        roots = [Path(r).resolve() for r in self.config.adapter_roots]
        if not roots:
            raise APIError(400, "runtime adapter loading is off: start the server with --adapter-root DIR",
                           "lora_path")
        for root in roots:
            path = (root / lora_path).resolve()  # an absolute lora_path replaces root here
            if path.is_relative_to(root):
                break
        else:
            raise APIError(400, "lora_path must lie inside one of the server's adapter roots", "lora_path")
        if not path.is_dir():
            raise APIError(404, f"no adapter folder at {lora_path!r}", "lora_path")
        if any(not f.resolve().is_relative_to(root) for f in path.iterdir()):
            raise APIError(400, "the adapter folder links to files outside the adapter roots", "lora_path")
        return path

    # ---- generation ------------------------------------------------------------------------

    async def call(self, fn, *args, param: str | None = None):
        """An input-processor call off the event loop (tokenizing a long prompt takes seconds);
        its ValueError is the request's fault: a 400 naming `param`."""
        try:
            return await asyncio.to_thread(fn, *args)
        except ValueError as exc:
            raise APIError(400, str(exc), param) from None

    async def run(self, prompts: list[list[int]], params: list[SamplingParams], adapter: str | None,
                  prefix: str) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, delta output) as any prompt's output grows, until all finish: the
        engine's one queue for this call, read directly. Leaving early (error, disconnect,
        timeout) aborts whatever is still running."""
        base_id = f"{prefix}-{uuid.uuid4().hex}"
        timers = [RequestTimer(self.metrics, adapter) for _ in prompts]
        generated: list[dict[int, int]] = [{} for _ in prompts]  # tokens so far per choice (deltas)
        reasons: list[dict[int, str | None]] = [{} for _ in prompts]
        for _ in prompts:
            self.metrics.count_request(adapter)
        outputs = self.engine.generate_many([{"prompt_token_ids": p} for p in prompts], params,
                                            [f"{base_id}-{i}" for i in range(len(prompts))], adapter)
        deadline = None if self.config.request_timeout_s is None else time.monotonic() + self.config.request_timeout_s
        async with contextlib.aclosing(outputs):
            while True:
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    i, delta = await asyncio.wait_for(anext(outputs), timeout)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    raise APIError(504, f"the request took longer than {self.config.request_timeout_s:g}s "
                                        f"(request timeout)") from None
                except Exception as exc:
                    raise _as_api_error(exc) from None
                for o in delta.outputs:
                    generated[i][o.index] = generated[i].get(o.index, 0) + len(o.token_ids)
                    reasons[i][o.index] = o.finish_reason
                timers[i].tokens(max(generated[i].values(), default=0))
                if delta.finished:
                    timers[i].finish(len(prompts[i]), list(reasons[i].values()), sum(generated[i].values()))
                yield i, delta

    async def until_disconnect(self, request: Request, awaitable):
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
        raise _ClientGone()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _SSEResponse(StreamingResponse):
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


class _BodyLimit:
    """413 for bodies over the limit, before any work is queued."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.limit:
            return await self._too_large(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:
                raise HTTPException(413, self._message())
            return message

        await self.app(scope, limited_receive, send)

    def _message(self) -> str:
        return f"request body larger than {self.limit} bytes (max_request_body_bytes)"

    async def _too_large(self, scope, receive, send) -> None:
        await _error(413, self._message())(scope, receive, send)


def build_app(engine: AsyncEngine, config: ServerConfig, shared: SharedAdapters | None = None) -> FastAPI:
    server = _Server(engine, config, shared)
    app = FastAPI(title="loraplex", version=loraplex.__version__,
                  description="OpenAI-compatible multi-LoRA, structured-output LLM server")
    app.state.server = server
    app.add_middleware(_BodyLimit, limit=config.max_request_body_bytes)
    user = [Depends(server.require_user)]
    admin = [Depends(server.require_admin)]
    inputs = engine.inputs

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        headers = {"Retry-After": "1"} if exc.status == 429 else None
        return _error(exc.status, exc.message, exc.param, headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return _error(400, fmt.validation_message(exc.errors()), fmt.validation_param(exc.errors()))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        api = _as_api_error(exc)
        return _error(api.status, api.message, api.param)

    @app.get("/health")
    async def health():
        if not engine.is_alive or engine.closing is not None:
            return _error(503, engine.closing or "the engine failed; see the server log")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": loraplex.__version__}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=user)
    async def models():
        return fmt.model_list(config.served_model_name, config.model_path, server.max_model_len,
                              server.created, await server.adapter_infos())

    @app.get("/v1/models/{model_id:path}", dependencies=user)
    async def model(model_id: str):
        cards = fmt.model_list(config.served_model_name, config.model_path, server.max_model_len,
                               server.created, await server.adapter_infos())["data"]
        for card in cards:
            if card["id"] == model_id:
                return card
        raise APIError(404, f"The model `{model_id}` does not exist.", "model")

    if config.enable_ui:  # static files only: every number on the page comes from the API, key and all
        app.mount("/ui", StaticFiles(directory=UI_DIR, html=True), name="ui")

    @app.get("/v1/adapters", dependencies=user)
    async def adapters():
        """loraplex's own: each registered adapter with its shape, where it is now, and what it
        served (the console's adapters view)."""
        status = engine.adapters.status()
        return fmt.adapter_list(await server.adapter_infos(), status, server.metrics.by_adapter)

    @app.get("/v1/stats", dependencies=user)
    async def stats():
        """loraplex's own: queues, KV usage, token totals and recent latency percentiles, as
        JSON (the console's live view; /metrics has the same for Prometheus)."""
        return server.metrics.snapshot()

    @app.post("/v1/validate_schema", dependencies=user)
    async def validate_schema(body: ValidateSchemaRequest):
        """Compile a JSON Schema as a response_format would be, without generating: what would
        be refused is a 400 naming the keyword (the console checks schemas as they are typed)."""
        spec = _checked(body.structured)
        compiled = await server.call(inputs.grammars.compile, spec, param="schema")
        return {"valid": True, "backend": compiled.backend, "unenforced_keywords": list(compiled.unenforced)}

    @app.post("/tokenize", dependencies=user)
    async def tokenize(body: TokenizeRequest):
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages")
        if body.messages is not None:
            ids = await server.call(inputs.chat_token_ids, _checked(chat_dicts, body.messages),
                                    body.add_generation_prompt, body.chat_template_kwargs, body.template_tools(),
                                    param="messages")
        else:
            ids = await server.call(inputs.token_ids, body.prompt, body.add_special_tokens, param="prompt")
        body = await asyncio.to_thread(_tokens_json, len(ids), server.max_model_len, ids)
        return Response(body, media_type="application/json")

    @app.post("/detokenize", dependencies=user)
    async def detokenize(body: DetokenizeRequest):
        return {"prompt": await server.call(inputs.detokenize, body.tokens, "tokens", param="tokens")}

    @app.post("/v1/completions", dependencies=user)
    async def completions(body: CompletionRequest, request: Request):
        adapter = await server.resolve_model(body.model)
        prompts = _checked(body.prompts)
        ids = [await server.call(inputs.token_ids, p, param="prompt") if isinstance(p, str) else p["prompt_token_ids"]
               for p in prompts]
        params = [_checked(body.sampling_params, _given(body.max_tokens, inputs.default_max_tokens(i)), body.logprobs,
                           body.num_prompt_logprobs()) for i in ids]
        echo = [p if isinstance(p, str) else await server.call(inputs.detokenize, p["prompt_token_ids"], "prompt",
                                                               param="prompt")
                for p in prompts] if body.echo else None
        view = fmt.CompletionView(body.model, body.n, echo, body.logprobs, body.prompt_logprobs is not None)
        return await _respond(server, request, body, ids, params, adapter, view)

    @app.post("/v1/chat/completions", dependencies=user)
    async def chat(body: ChatCompletionRequest, request: Request):
        adapter = await server.resolve_model(body.model)
        ids = await server.call(inputs.chat_token_ids, _checked(body.chat_messages), body.add_generation_prompt,
                                body.chat_template_kwargs, _checked(body.prompt_tools), param="messages")
        max_tokens = _given(body.max_completion_tokens, _given(body.max_tokens, inputs.default_max_tokens(ids)))
        params = _checked(body.sampling_params, max_tokens, _checked(body.num_logprobs), body.prompt_logprobs)
        tools = params.structured is not None and params.structured.kind == "tools"
        view = fmt.ChatView(body.model, body.n, body.top_logprobs or 0, tools)
        return await _respond(server, request, body, [ids], [params], adapter, view)

    @app.post("/v1/load_lora_adapter", dependencies=admin)
    async def load_lora_adapter(body: LoadAdapterRequest):
        adapters = engine.adapters
        taken = APIError(400, f"The lora adapter '{body.lora_name}' has already been loaded.", "lora_name")
        if body.lora_name in {a.name for a in await server.adapter_infos()}:
            raise taken
        path = server.adapter_path(body.lora_path)
        try:
            info = await asyncio.to_thread(adapters.load, body.lora_name, str(path), False, True)
        except ValueError as exc:
            raise APIError(400, str(exc), "lora_path") from None
        if server.shared is not None and not await server.shared.register(info):  # another replica won
            with contextlib.suppress(ValueError):
                adapters.unload(body.lora_name)
            raise taken
        log.info("loaded adapter %r from %s", body.lora_name, path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", dependencies=admin)
    async def unload_lora_adapter(body: UnloadAdapterRequest):
        missing = APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", "lora_name")
        if server.shared is not None:  # each replica lets its copy go once its requests end
            if not await server.shared.unregister(body.lora_name):
                raise missing
        else:
            try:
                engine.adapters.unload(body.lora_name)
            except UnknownAdapterError:
                raise missing from None
        log.info("unloaded adapter %r", body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    return app


def _given(value, default):
    """`value` unless the client left it out (0 is a value: SamplingParams refuses it)."""
    return default if value is None else value


def _checked(fn, *args):
    """Call a body's converter, turning its ValueError into a 400."""
    try:
        return fn(*args)
    except ValueError as exc:
        raise APIError(400, str(exc)) from None


async def _respond(server: _Server, request: Request, body, ids: list[list[int]], params: list[SamplingParams],
                   adapter: str | None, view: fmt.View) -> Response:
    updates = server.run(ids, params, adapter, view.id_prefix)
    try:
        if not body.stream:
            async def collect() -> list[RequestOutput]:
                final: dict[int, RequestOutput] = {}
                async with contextlib.aclosing(updates) as it:
                    async for i, out in it:
                        final[i] = accumulate(final.get(i), out)
                return [final[i] for i in range(len(ids))]

            outputs = await server.until_disconnect(request, collect())
            return JSONResponse(view.response(outputs), headers=_unenforced_header(outputs))
        # errors before the first output (validation, unknown adapter, bad schema) are plain HTTP
        first = await server.until_disconnect(request, anext(updates))
    except _ClientGone:
        return Response(status_code=499)
    except Exception:
        await updates.aclose()
        raise
    return _SSEResponse(_sse(updates, first, view, body.include_usage), _unenforced_header([first[1]]))


def _unenforced_header(outputs: list[RequestOutput]) -> dict[str, str]:
    """strict: false: the schema keywords its grammar dropped, also in the body's
    `unenforced_keywords`."""
    unenforced = fmt.unenforced(outputs)
    return {UNENFORCED_HEADER: "; ".join(unenforced)} if unenforced else {}


async def _sse(updates: AsyncIterator[tuple[int, RequestOutput]], first: tuple[int, RequestOutput],
               view: fmt.View, include_usage: bool) -> AsyncIterator[str]:
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
        api = _as_api_error(exc)
        yield fmt.sse(fmt.error_body(api.status, api.message, api.param))
    finally:
        await updates.aclose()
    yield "data: [DONE]\n\n"
