"""What each failure means to a client: `APIError` (status, message, param), the mapping of
engine errors onto statuses, and the handlers that write OpenAI's error body for all of them."""

from __future__ import annotations

import contextlib
import logging
from contextvars import ContextVar
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from loraplex.api.openai import openai_format as fmt
from loraplex.grammar.backend import WorkerGone
from loraplex.grammar.tooling.tools import ToolCallError
from loraplex.platform.engine.engine_client import (AdapterInUseError, ClientTooSlowError, EngineDeadError,
                                             QueueFullError, StepFailedError, UnknownAdapterError)

log = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, retry_after: str = "1") -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.retry_after = retry_after  # a 429's Retry-After, in seconds


# engine-side failures, most specific first; any other ValueError is the request's own fault (a
# malformed tool call is the output's: under the grammar it is a bug, reported, never hidden; a
# compile worker killed from outside is the server's, and a retry compiles on a fresh one)
_STATUSES = ((UnknownAdapterError, 404, "model"), (AdapterInUseError, 409, None), (QueueFullError, 429, None),
             (EngineDeadError, 503, None), (WorkerGone, 503, None), (StepFailedError, 500, None),
             (ClientTooSlowError, 408, None), (ToolCallError, 500, None), (ValueError, 400, None))


# the current request's answer for an adapter it names that the engine does not know (unloaded after
# `AdapterDirectory` resolved it, which sets this): the 404 of a name that never existed, never the
# registry's own words
unknown_adapter: ContextVar[Callable[[str], APIError] | None] = ContextVar("unknown_adapter", default=None)


def as_api_error(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, UnknownAdapterError):
        return _unknown_adapter(exc)
    for kind, status, param in _STATUSES:
        if isinstance(exc, kind):
            if kind is ToolCallError:
                log.error("an output's tool calls could not be read back: %s", exc)
            return APIError(status, str(exc), param)
    log.exception("unexpected error", exc_info=exc)
    return APIError(500, "internal server error; see the server log")


def _unknown_adapter(exc: UnknownAdapterError) -> APIError:
    answer = unknown_adapter.get()
    return answer(exc.name) if answer is not None else APIError(404, f"The model `{exc.name}` does not exist.",
                                                                 "model")


def error_response(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(fmt.error_body(status, message, param), status_code=status, headers=headers)


@contextlib.contextmanager
def bad_input(param: str | None = None):
    """A ValueError raised inside is the request's fault: a 400 naming `param`."""
    try:
        yield
    except ValueError as exc:
        raise APIError(400, str(exc), param) from None


def install_error_handlers(app: FastAPI, shown: Callable[[Request, str], str] = lambda request, text: text) -> None:
    """OpenAI's error body for every failure. `shown`: a message as this caller may see it (the
    server's folders hidden from all but the admin). An expected refusal (a 4xx, or an engine
    error of `_STATUSES`) logs one line; only an unexpected error logs its traceback."""
    def respond(request: Request, api: APIError, headers: dict | None = None) -> JSONResponse:
        if api.status < 500:  # repr: a client's text with a line break cannot forge a log line
            # a 401's hint spells the Authorization header, which log scanners take for a leaked key
            said = "no valid key" if api.status == 401 else api.message
            log.info("%s %r: %d %r", request.method, request.url.path, api.status, said)
        return error_response(api.status, shown(request, api.message), api.param, headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return respond(request, exc, {"Retry-After": exc.retry_after} if exc.status == 429 else None)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return respond(request, APIError(400, fmt.validation_message(exc.errors()), fmt.validation_param(exc.errors())))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        return respond(request, APIError(exc.status_code, str(exc.detail)))

    # each known kind gets its own handler: starlette re-raises what reaches the catch-all one (so
    # the server logs its traceback), which is right for a bug only
    async def _known(request: Request, exc: Exception):
        return await _api_error(request, as_api_error(exc))

    for kind, _, _ in _STATUSES:
        app.add_exception_handler(kind, _known)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return await _api_error(request, as_api_error(exc))
