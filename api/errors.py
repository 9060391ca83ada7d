"""What each failure means to a client: `APIError` (status, message, param), the mapping of
engine errors onto statuses, and the handlers that write OpenAI's error body for all of them."""

from __future__ import annotations

import contextlib
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from loraplex.api import openai_format as fmt
from loraplex.grammar.tools import ToolCallError
from loraplex.platform.engine_client import (AdapterInUseError, ClientTooSlowError, EngineDeadError,
                                             QueueFullError, StepFailedError, UnknownAdapterError)

log = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


# engine-side failures, most specific first; any other ValueError is the request's own fault (a
# malformed tool call is the output's: under the grammar it is a bug, reported, never hidden)
_STATUSES = ((UnknownAdapterError, 404, "model"), (AdapterInUseError, 409, None), (QueueFullError, 429, None),
             (EngineDeadError, 503, None), (StepFailedError, 500, None), (ClientTooSlowError, 408, None),
             (ToolCallError, 500, None), (ValueError, 400, None))


def as_api_error(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    for kind, status, param in _STATUSES:
        if isinstance(exc, kind):
            if kind is ToolCallError:
                log.error("an output's tool calls could not be read back: %s", exc)
            return APIError(status, str(exc), param)
    log.exception("unexpected error", exc_info=exc)
    return APIError(500, "internal server error; see the server log")


def error_response(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(fmt.error_body(status, message, param), status_code=status, headers=headers)


@contextlib.contextmanager
def bad_input(param: str | None = None):
    """A ValueError raised inside is the request's fault: a 400 naming `param`."""
    try:
        yield
    except ValueError as exc:
        raise APIError(400, str(exc), param) from None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        headers = {"Retry-After": "1"} if exc.status == 429 else None
        return error_response(exc.status, exc.message, exc.param, headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return error_response(400, fmt.validation_message(exc.errors()), fmt.validation_param(exc.errors()))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        api = as_api_error(exc)
        return error_response(api.status, api.message, api.param)
