"""Engine and request failures -> OpenAI error bodies: {"error": {"message", "type", "param", "code"}}; on the
Anthropic Messages API's paths, Anthropic's: {"type": "error", "error": {"type", "message"}}.

Status codes: 400 malformed request or too long for the context, 401 wrong API key, 404 unknown model or path,
503 (+ Retry-After) while loading, when the queue is full, while draining, or when the engine has died, 500 for
anything unexpected. Messages are cut to MAX_MESSAGE_CHARS: a validation error must never echo a huge input back
(vLLM once answered a few-KB request with a 114 MB error body).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from moeserve.engine.async_engine import EngineDeadError, EngineLoadingError, QueueFullError
from moeserve.errors import ExpertLoadError, MoeserveError, RequestError
from moeserve.server.log_text import client_text
from moeserve.server.protocol import printable

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


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "function-after", "json-or-python"})
_SHOWN_VALUE_CHARS = 40  # a wrong value is quoted in the error when it is a scalar this short


def client_path(loc: tuple[Any, ...] | list[Any]) -> list[str]:
    """A pydantic error location as the path the client wrote: "body" and union branch tags ("list[int]",
    "function-after[...]") dropped, so no Python repr reaches the client. Items: a field name or an index."""
    out: list[str] = []
    for part in loc:
        if isinstance(part, int):
            out.append(str(part))
        elif part != "body" and part.isidentifier() and part not in _TYPE_TAGS:
            out.append(part)
    return out


def _joined(path: list[str]) -> str:
    return ".".join(path)  # messages.0.content: as the errors of OpenAI's API write it


def _shown_value(value: Any) -> str:
    """` (got 1.5)`: the value that broke the rule, when it is a short scalar; never a container or a long text."""
    if isinstance(value, bool) or value is None:
        return f" (got {'null' if value is None else str(value).lower()})"
    if isinstance(value, (int, float)):
        text = repr(value)
        return f" (got {text})" if len(text) <= _SHOWN_VALUE_CHARS else ""
    if isinstance(value, str) and len(value) <= _SHOWN_VALUE_CHARS:
        return f" (got the string {printable(value)!r})"
    return ""


def _rule(message: str) -> str:
    """pydantic's message without any Python repr left in it (an object address, a function)."""
    return _PY_REPR.sub("...", message)


_PY_REPR = re.compile(r"<[^<>]* at 0x[0-9a-fA-F]+>|functools\.partial\([^)]*\)")


def _validation_message(err: RequestValidationError) -> tuple[str, str | None]:
    """One line in the client's terms: each broken rule as `field (got value): rule`, the field as the client
    wrote it; a union's branches that failed at the same field are one item."""
    unknown = [item for item in err.errors() if item.get("type") == "unrecognized_argument"]
    if unknown:  # one clear line, as OpenAI answers (other errors of a union's branches would only blur it)
        path = client_path(unknown[0].get("loc", ()))
        where = _joined(path)
        field = str((unknown[0].get("ctx") or {}).get("field", ""))
        return (f"{where}: " if where else "") + str(unknown[0].get("msg")), _joined([*path, field])
    parts: list[str] = []
    seen: set[str] = set()
    first_param: str | None = None
    errors = err.errors()
    for item in errors:
        if item.get("type") == "json_invalid":  # loc is ("body", character offset): not a field
            offset = (item.get("loc") or ("", "?"))[-1]
            why = (item.get("ctx") or {}).get("error", "JSON decode error")
            text = f"the body is not valid JSON ({why} at character {offset})"
        else:
            where = _joined(client_path(item.get("loc", ()))) or "body"
            first_param = first_param or (where if where != "body" else None)  # the whole body is no field
            text = f"{where}{_shown_value(item.get('input'))}: {_rule(str(item.get('msg', 'invalid')))}"
        if text not in seen and len(parts) < MAX_VALIDATION_ERRORS:
            seen.add(text)
            parts.append(text)
    more = len(errors) - len(parts) if len(parts) == MAX_VALIDATION_ERRORS else 0
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
