"""Engine and request failures -> OpenAI error bodies: {"error": {"message", "type", "param", "code"}}; on the
Anthropic Messages API's paths, Anthropic's: {"type": "error", "error": {"type", "message"}}.

Status codes: 400 malformed request or too long for the context, 401 wrong API key, 404 unknown model or path,
503 (+ Retry-After) while loading, when the queue is full, while draining, or when the engine has died, 500 for
anything unexpected. Messages are cut to MAX_MESSAGE_CHARS: a validation error must never echo a huge input back
(vLLM once answered a few-KB request with a 114 MB error body).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from moeserve.engine.async_engine import EngineDeadError, EngineLoadingError, QueueFullError
from moeserve.errors import ExpertLoadError, MoeserveError, RequestError
from moeserve.server.log_text import client_text

log = logging.getLogger("moeserve.server")

MAX_MESSAGE_CHARS = 1000
MAX_VALIDATION_ERRORS = 3


class APIError(Exception):
    """An error with its HTTP status and OpenAI error fields, raised by request handlers."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def short_message(self) -> str:
        return self.message if len(self.message) <= MAX_MESSAGE_CHARS else \
            self.message[:MAX_MESSAGE_CHARS] + "... (truncated)"

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.short_message(), "type": self.type, "param": self.param,
                          "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        """The error in the Anthropic Messages API's shape: {"type": "error", "error": {"type", "message"}}."""
        kind = ANTHROPIC_ERROR_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.short_message()}}

    def response(self, path: str = "") -> JSONResponse:
        """The error's response, in the shape of the API that `path` belongs to."""
        shape = ERROR_SHAPES.get(path.rstrip("/"), APIError.body)
        return JSONResponse(shape(self), status_code=self.status, headers=self.headers)


ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                         503: "overloaded_error"}

# Paths whose errors take another API's shape; every other path answers in OpenAI's.
ERROR_SHAPES: dict[str, Callable[[APIError], dict[str, Any]]] = {
    "/v1/messages": APIError.anthropic_body, "/v1/messages/count_tokens": APIError.anthropic_body}


def model_not_found(name: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")


def from_exception(err: BaseException) -> APIError:
    """Map any exception raised while serving a request to an APIError."""
    if isinstance(err, APIError):
        return err
    if isinstance(err, RequestError):
        return APIError(400, str(err), param=err.param, code=err.code)
    if isinstance(err, QueueFullError):
        return APIError(503, str(err), "server_error", code="server_busy", headers={"Retry-After": "1"})
    if isinstance(err, EngineLoadingError):
        return APIError(503, str(err), "server_error", code="model_loading", headers={"Retry-After": "5"})
    if isinstance(err, EngineDeadError):
        return APIError(503, str(err), "server_error", code="engine_dead")
    if isinstance(err, ExpertLoadError):  # a server fault (a file changed, corrupt or unreadable), not the request's
        return APIError(500, str(err), "server_error", code="expert_load_failed")
    if isinstance(err, MoeserveError):
        return APIError(400, str(err))
    log.error("internal error while serving a request", exc_info=err)
    return APIError(500, f"internal server error: {type(err).__name__}", "server_error", code="internal_error")


def _validation_message(err: RequestValidationError) -> tuple[str, str | None]:
    unknown = [item for item in err.errors() if item.get("type") == "unrecognized_argument"]
    if unknown:  # one clear line, as OpenAI answers (other errors of a union's branches would only blur it)
        # drop "body" and pydantic's union branch tags ("list[ContentPart]"): the path the client wrote
        loc = [str(p) for p in unknown[0].get("loc", ()) if p != "body" and (isinstance(p, int) or p.isidentifier())]
        where = ".".join(loc)
        field = str((unknown[0].get("ctx") or {}).get("field", ""))
        return (f"{where}: " if where else "") + str(unknown[0].get("msg")), ".".join([*loc, field])
    parts = []
    first_param: str | None = None
    for item in err.errors()[:MAX_VALIDATION_ERRORS]:
        if item.get("type") == "json_invalid":  # loc is ("body", character offset): not a field
            offset = (item.get("loc") or ("", "?"))[-1]
            why = (item.get("ctx") or {}).get("error", "JSON decode error")
            parts.append(f"the body is not valid JSON ({why} at character {offset})")
            continue
        loc = [str(p) for p in item.get("loc", ()) if p != "body"]
        where = ".".join(loc) or "body"
        first_param = first_param or (where if loc else None)  # the whole body is no field to name
        parts.append(f"{where}: {item.get('msg', 'invalid')}")  # never the input itself: it may be huge
    more = len(err.errors()) - MAX_VALIDATION_ERRORS
    if more > 0:
        parts.append(f"and {more} more")
    return "invalid request: " + "; ".join(parts), first_param


def log_client_error(method: str, path: str, err: APIError) -> None:
    """A client error (4xx) in one INFO line, escaped and cut (never a traceback: a fuzzer's bad requests must not
    bury the log, nor forge lines in it)."""
    if err.status < 500:
        log.info("%s %s -> %d: %s", method, client_text(path), err.status, client_text(err.message))


def answer(request: Request, err: APIError) -> JSONResponse:
    """The error's response, logged by log_client_error."""
    log_client_error(request.method, request.url.path, err)
    return err.response(request.url.path)


def install_error_handlers(app: FastAPI) -> None:
    """Every error the app can produce leaves in the OpenAI shape. Exceptions of other types are answered by
    guard.RequestGuard (Starlette's catch-all handler would re-raise them and close the connection)."""

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, err: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(err)
        return answer(request, APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return answer(request, APIError(err.status_code, str(err.detail), kind, headers=dict(err.headers or {})))

    @app.exception_handler(APIError)
    async def _api(request: Request, err: APIError) -> JSONResponse:
        return answer(request, err)

    @app.exception_handler(Exception)
    async def _any(request: Request, err: Exception) -> JSONResponse:
        return from_exception(err).response(request.url.path)
