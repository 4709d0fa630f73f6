"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the right HTTP status.

Bad input is always a 4xx: malformed JSON and pydantic validation errors become 400 (not FastAPI's
422), `InvalidRequestError`s become 400 naming the parameter, a full queue is 429 with Retry-After, an
engine that is loading or shutting down is 503, and so is a dead engine (the process is exiting for its
supervisor to restart it). 500 is for one request's own failure inside the engine or the handler. No
message carries a traceback or a file path: those go to the server log.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from deterministic_inference.engine.async_engine import (
    EngineNotReadyError,
    QueueFullError,
    RequestFailedError,
    ShutdownAbortError,
)
from deterministic_inference.errors import DetinfError, EngineDeadError, InvalidRequestError
from deterministic_inference.server.formatting import json_response

logger = logging.getLogger("detinf.server")


class APIError(Exception):
    """An error answered to the client as-is (status, OpenAI type, param, code)."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The OpenAI error body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        """A JSON response carrying this error."""
        return json_response(self.body(), status_code=self.status, headers=self.headers)


def as_api_error(error: BaseException) -> APIError:
    """Map any exception raised while serving to the APIError the client sees."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, InvalidRequestError):
        return APIError(400, str(error), param=error.param, code="invalid_value")
    if isinstance(error, QueueFullError):
        return APIError(
            429,
            str(error),
            "rate_limit_error",
            code="queue_full",
            headers={"Retry-After": str(error.retry_after)},
        )
    if isinstance(error, ShutdownAbortError):
        return APIError(503, str(error), "service_unavailable", code="shutting_down")
    if isinstance(error, EngineNotReadyError):
        return APIError(
            503, str(error), "service_unavailable", code="engine_not_ready", headers={"Retry-After": "1"}
        )
    if isinstance(error, EngineDeadError):
        return APIError(503, str(error), "service_unavailable", code="engine_dead")
    if isinstance(error, RequestFailedError):
        return APIError(500, str(error), "server_error", code="request_failed")
    if isinstance(error, DetinfError):
        return APIError(400, str(error), code="invalid_request")
    logger.error("internal error while serving", exc_info=error)
    return APIError(
        500, f"internal server error ({type(error).__name__})", "server_error", code="internal_error"
    )


class InvalidBodyError(HTTPException):
    """A request body that is not acceptable JSON; carries the APIError to answer. An HTTPException so
    that FastAPI's body parsing lets it through unchanged."""

    def __init__(self, error: APIError) -> None:
        super().__init__(error.status, error.message)
        self.api_error = error


def validation_error(error: ValidationError | RequestValidationError) -> APIError:
    """400 naming the first offending field of a pydantic validation error."""
    details = error.errors()
    if not details:
        return APIError(400, "invalid request body")
    first = details[0]
    loc = [part for part in first.get("loc", ()) if part != "body"]
    if not loc:  # the body as a whole
        if first.get("type") == "missing":
            return APIError(400, "the request body is empty; send a JSON object", code="invalid_json")
        return APIError(400, "the request body must be a JSON object", code="invalid_json")
    param = field_path(loc) or None
    where = f"{param}: " if param else ""
    return APIError(400, f"{where}{first.get('msg', 'invalid value')}", param=param, code="invalid_type")


def field_path(loc: list[Any]) -> str:
    """A pydantic loc as the request's field path ("messages[0].content"), without pydantic's
    union-branch labels ("str", "list[int]", "function-after[...]", a model's class name)."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not any(ch in part for ch in "[]()") and part not in _TYPE_LABELS and not part[:1].isupper():
            path += f".{part}" if path else part
    return path


_TYPE_LABELS = {"str", "int", "float", "bool", "list", "dict", "none", "literal", "tagged-union"}


def install_error_handlers(app: FastAPI) -> None:
    """Route every error through `as_api_error` so clients always get an OpenAI error body."""

    async def on_api_error(_: Request, error: Exception) -> Response:
        return as_api_error(error).response()

    async def on_validation(_: Request, error: Exception) -> Response:
        if isinstance(error, RequestValidationError | ValidationError):
            return validation_error(error).response()
        return as_api_error(error).response()

    async def on_http(_: Request, error: Exception) -> Response:
        if isinstance(error, InvalidBodyError):
            return error.api_error.response()
        status = getattr(error, "status_code", 500)
        detail = getattr(error, "detail", "error")
        codes = {404: "not_found", 405: "method_not_allowed"}
        return APIError(status, str(detail), code=codes.get(status)).response()

    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(ValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_api_error)
    for error_type in (APIError, DetinfError):
        app.add_exception_handler(error_type, on_api_error)
