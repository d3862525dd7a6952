"""RequestGuard: the ASGI layer in front of every route. It holds the line the routes cannot, in this order:

- the API key (with one set): nothing but the key check happens before a 401, not even reading the body
  (`/health` and `/metrics` need no key);
- the number of requests in progress (`max_concurrent_requests`; `/health` and `/metrics` are never counted nor
  refused): a 503 + Retry-After beyond it, before the body is read;
- request memory (request_memory.py): the body's bytes and what parsing and tokenizing them takes are charged to
  the request budget before the body is read; 503 + Retry-After when it is in use, 413 when it could never fit;
- the body's arrival: all of it within `body_timeout_s` of the head (a slow sender holds a connection and a slot
  for no longer), else a 408;
- the body-size limit (`max_request_body_mb`): a Content-Length beyond it is a 413 before a byte is read, and a
  body streamed in without one (chunked) is counted as it arrives and cut at the limit with the same 413;
- lone UTF-16 surrogates (`"\\ud800"` in JSON parses to a Python str that cannot be encoded): a 400 naming the
  field, for every route at once, before pydantic or a tokenizer sees the string; a body that is not UTF-8 (an
  encoded surrogate included) is a 400 too;
- a body nested deeper than Python's recursion limit: a 400, from any parser (never a 500 with a traceback);
- exceptions that escape a route: answered here in the OpenAI shape (Starlette's catch-all handler re-raises
  after answering, and uvicorn then logs a traceback and closes a keep-alive connection); a client gone before
  its answer is one INFO line, not a traceback;
- memory: after a large request the C allocator returns its freed pages to the system (`malloc_trim`), so a few
  10 MB prompts do not leave their peak in the process's RSS.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import hmac
import json
import logging
import re
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from moeserve.server.errors import APIError, from_exception, log_client_error
from moeserve.server.log_text import client_text
from moeserve.server.request_memory import MemoryRefused, RequestMemory
from moeserve.server.streaming import ClientGone

log = logging.getLogger("moeserve.server")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

TRIM_AFTER_BYTES = 1 << 20  # a body at least this large is followed by malloc_trim
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # a JSON escape of a UTF-16 surrogate, paired or not
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
OPEN_PATHS = frozenset({"/health", "/metrics"})  # no key, never counted nor refused: probes must always answer


@dataclass(frozen=True)
class GuardLimits:
    """What the guard enforces (ServerSettings' values). `api_key` None: no key needed."""

    max_body_bytes: int
    api_key: str | None = None
    max_concurrent_requests: int = 1 << 30
    body_timeout_s: float = 1e9
    memory: RequestMemory | None = None


def key_matches(headers: dict[bytes, bytes], expected: str) -> bool:
    """The request carries `expected` as a Bearer token (OpenAI clients) or in x-api-key (Anthropic clients);
    compared in constant time."""
    header = headers.get(b"authorization", b"")
    given = header[7:] if header[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
    return hmac.compare_digest(given, expected.encode())


def nests_too_deeply() -> APIError:
    return APIError(400, "the request body nests too deeply (JSON arrays and objects inside each other beyond what "
                    "the server parses); flatten it", param=None)


class _Refused(Exception):
    def __init__(self, error: APIError | None) -> None:  # None: the client went away while sending
        self.error = error


def _load_trim() -> Callable[[int], Any] | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return None if libc is None else getattr(libc, "malloc_trim", None)  # glibc only
    except OSError:
        return None


_MALLOC_TRIM = _load_trim()


def trim_memory() -> None:
    """Give the allocator's free pages back to the system (glibc's malloc_trim; nothing elsewhere)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def too_large(limit_bytes: int) -> APIError:
    return APIError(413, f"the request body is larger than this server accepts ({limit_bytes / 1e6:g} MB, "
                    "max_request_body_mb)", param=None, code="request_too_large")


def lone_surrogate(value: Any, path: str = "") -> str | None:
    """The path of the first string (or key) in parsed JSON holding a lone UTF-16 surrogate, else None."""
    if isinstance(value, str):
        return (path or "body") if _LONE_SURROGATE.search(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if _LONE_SURROGATE.search(str(key)):
                return where
            found = lone_surrogate(item, where)
            if found is not None:
                return found
    if isinstance(value, list):
        for i, item in enumerate(value):
            found = lone_surrogate(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def check_unicode(body: bytes) -> None:
    """Raise a 400 APIError when the JSON body is not UTF-8 (Python's json reads bytes with `surrogatepass`, so an
    encoded surrogate became a lone one) or holds a lone surrogate escape (a valid pair is one character)."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as err:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {err.start}: {err.reason}); JSON must be "
                       "sent as UTF-8") from None
    if not _SURROGATE_ESCAPE.search(body):
        return
    try:
        parsed = json.loads(body)
        where = lone_surrogate(parsed)
    except ValueError:
        return  # not JSON: the route's parser answers 400
    except RecursionError:
        raise nests_too_deeply() from None
    if where is not None:
        raise APIError(400, f"{client_text(where)}: a lone UTF-16 surrogate is not a character; JSON strings must "
                       "be valid Unicode (send a surrogate pair or the character itself)", param=client_text(where))


class RequestGuard:
    """Pure ASGI middleware (see the module docstring)."""

    def __init__(self, app: ASGIApp, limits: GuardLimits) -> None:
        self.app, self.limits = app, limits
        self.in_progress = 0  # requests past the key check, not on OPEN_PATHS

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope.get("path") in OPEN_PATHS:
            await self._serve(scope, [], receive, send)
            return
        headers = dict(scope.get("headers") or [])
        limits = self.limits
        if limits.api_key is not None and not key_matches(headers, limits.api_key):
            await self._answer(APIError(401, "Incorrect API key provided.", param=None, code="invalid_api_key"),
                               scope, receive, send)
            return
        if self.in_progress >= limits.max_concurrent_requests:
            await self._answer(APIError(503, f"the server has {self.in_progress} requests in progress, its limit "
                                        "(max_concurrent_requests); retry shortly", "server_error",
                                        code="server_busy", headers={"Retry-After": "1"}), scope, receive, send)
            return
        self.in_progress += 1
        try:
            await self._admitted(scope, headers, receive, send)
        finally:
            self.in_progress -= 1

    async def _admitted(self, scope: Scope, headers: dict[bytes, bytes], receive: Receive, send: Send) -> None:
        declared = headers.get(b"content-length")
        size = int(declared) if declared is not None and declared.isdigit() else None
        if size is not None and size > self.limits.max_body_bytes:
            await self._answer(too_large(self.limits.max_body_bytes), scope, receive, send)
            return
        memory = self.limits.memory
        charge = 0
        try:
            if memory is not None:
                charge = memory.admit(self.limits.max_body_bytes if size is None else size)
        except MemoryRefused as refused:
            error = APIError(413, str(refused), param=None, code="request_too_large") if refused.never else \
                APIError(503, str(refused), "server_error", code="server_busy", headers={"Retry-After": "1"})
            await self._answer(error, scope, receive, send)
            return
        try:
            await self._read_and_serve(scope, receive, send)
        finally:
            if memory is not None:
                memory.release(charge)

    async def _read_and_serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = await asyncio.wait_for(self._read_body(scope, receive), self.limits.body_timeout_s)
            check_unicode(body)
        except _Refused as refused:
            if refused.error is not None:
                await self._answer(refused.error, scope, receive, send)
            return
        except TimeoutError:
            await self._answer(APIError(408, f"the request body did not arrive within {self.limits.body_timeout_s:g}"
                                        " s (body_timeout_s)", param=None, code="request_timeout"),
                               scope, receive, send)
            return
        except APIError as err:
            await self._answer(err, scope, receive, send)
            return
        pending = [body]  # handed to the app once, then not held here for the rest of the request
        del body
        await self._serve(scope, pending, receive, send)

    async def _serve(self, scope: Scope, pending: list[bytes], receive: Receive, send: Send) -> None:
        started = False
        large = bool(pending) and len(pending[0]) >= TRIM_AFTER_BYTES

        async def replay() -> Message:  # the body once, then the real channel (for disconnects)
            if pending:
                return {"type": "http.request", "body": pending.pop(), "more_body": False}
            return await receive()

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            if large and message["type"] == "http.response.body" and not message.get("more_body", False):
                trim_memory()  # before the last byte leaves: a client that has its answer sees the RSS back
            await send(message)

        try:
            await self.app(scope, replay, tracked)
        except ClientGone:
            log.info("%s %s: the client disconnected before the answer", scope.get("method"),
                     client_text(scope.get("path", "")))
        except RecursionError:  # a parser deeper than Python's limit: the body's fault, not a bug
            if not started:
                await self._answer(nests_too_deeply(), scope, replay, send)
        except Exception as err:
            if started:  # the status line left already: nothing to answer with
                log.error("%s %s failed after its answer started: %s", scope.get("method"),
                          client_text(scope.get("path", "")), client_text(repr(err)))
                return
            await self._answer(from_exception(err), scope, replay, send)

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        limit = self.limits.max_body_bytes
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Refused(None)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _Refused(too_large(limit))
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    @staticmethod
    async def _answer(err: APIError, scope: Scope, receive: Receive, send: Send) -> None:
        log_client_error(str(scope.get("method")), str(scope.get("path", "")), err)
        await err.response(str(scope.get("path", "")))(scope, receive, send)
