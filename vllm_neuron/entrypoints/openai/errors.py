"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with vLLM's type names.

Serving code raises `OpenAIError` subclasses where a bad value enters; the exception handlers
installed by `install_exception_handlers` turn them (and FastAPI's own errors, engine errors and
unexpected faults) into that shape. A ValueError raised by the engine for a request is the
client's fault (400; the serving code converts it, see `from_exception`); anything else
unexpected is a 500 and is logged with its traceback.
"""
from __future__ import annotations

from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from vllm_neuron.engine.protocol import EngineDeadError, EngineRequestError
from vllm_neuron.entrypoints.openai.protocol import ErrorInfo, ErrorResponse
from vllm_neuron.logger import init_logger

logger = init_logger(__name__)

_TYPE_BY_STATUS = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class OpenAIError(Exception):
    status_code: int = 500

    def __init__(self, message: str, param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or {}  # e.g. Retry-After on a 503


class BadRequestError(OpenAIError):
    status_code = 400


class AuthenticationError(OpenAIError):
    status_code = 401


class NotFoundError(OpenAIError):
    status_code = 404


class RequestTimeoutError(OpenAIError):
    status_code = 408


class RequestTooLargeError(OpenAIError):
    status_code = 413


class UnsupportedMediaTypeError(OpenAIError):
    status_code = 415


class ServiceUnavailableError(OpenAIError):
    status_code = 503


class InternalServerError(OpenAIError):
    status_code = 500


def error_type(status_code: int) -> str:
    if status_code in _TYPE_BY_STATUS:
        return _TYPE_BY_STATUS[status_code]
    return "BadRequestError" if 400 <= status_code < 500 else "InternalServerError"


def error_body(message: str, status_code: int, param: str | None = None) -> ErrorResponse:
    return ErrorResponse(error=ErrorInfo(message=message, type=error_type(status_code), param=param,
                                         code=status_code))


def error_response(message: str, status_code: int, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(status_code=status_code, content=error_body(message, status_code, param).model_dump(),
                        headers=headers)


def from_exception(exc: BaseException) -> ErrorResponse:
    """The error object for an exception raised while serving (also used inside SSE streams)."""
    if isinstance(exc, OpenAIError):
        return error_body(exc.message, exc.status_code, exc.param)
    if isinstance(exc, EngineDeadError):
        return error_body(f"The engine is dead: {exc}" if str(exc) else "The engine is dead.", 500)
    if isinstance(exc, EngineRequestError):
        return error_body(f"Internal server error: {exc}", 500)
    if isinstance(exc, ValueError):
        return error_body(str(exc), 400)
    return error_body(f"Internal server error: {type(exc).__name__}: {exc}", 500)


def format_validation_error(exc: ValidationError | RequestValidationError,
                            prefix: tuple = ()) -> tuple[str, str | None]:
    """(message, param) of a pydantic error list; param is the first failing field's dotted path."""
    errors = exc.errors()
    parts, param = [], None
    for err in errors:
        loc = tuple(err.get("loc", ()))
        if loc[:1] == ("body",):
            loc = loc[1:]
        path = ".".join(str(p) for p in prefix + loc)
        if err.get("type") == "json_invalid":
            parts.append(f"Invalid JSON body: {err.get('msg')}")
            continue
        if param is None and path:
            param = path
        parts.append(f"{path}: {err.get('msg')}" if path else str(err.get("msg")))
    return "; ".join(parts) or "Invalid request", param


def install_exception_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc.message, exc.status_code, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = format_validation_error(exc)
        return error_response(message, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        try:
            phrase = HTTPStatus(exc.status_code).phrase
        except ValueError:
            phrase = "Error"
        message = exc.detail if isinstance(exc.detail, str) and exc.detail else phrase
        response = error_response(message, exc.status_code)
        response.headers.update(exc.headers or {})  # e.g. Allow on a 405
        return response

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        body = from_exception(exc)
        return JSONResponse(status_code=500, content=body.model_dump())

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        # A fault of ours, whatever the exception's type: the status and the body both say 500.
        logger.exception("Unexpected error while serving a request")
        return error_response(f"Internal server error: {type(exc).__name__}: {exc}", 500)
