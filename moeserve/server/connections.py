"""Connection hygiene under uvicorn: what a client that holds sockets open, or sends slowly, can take, bounded.

- The head of each request (its request line and headers) must arrive within `header_timeout_s` of the
  connection opening or of the previous answer; else the connection is closed. This covers sockets that never send
  a byte, slow headers, and a client that trickles on after its answer (uvicorn's keep-alive timer restarts on
  every byte it gets). An idle keep-alive connection closes after `timeout_keep_alive_s` (uvicorn's own timer).
  The head's size is bounded by h11 (`h11_max_incomplete_event_size`: 16 KiB, a 400 beyond).
- At most `max_connections` are open: a connection beyond it closes the oldest connection that has no request in
  progress (idle, or still sending its head), so a new client (a load balancer's /health probe) always gets in;
  when every connection has a request in progress, the new one is closed. Requests in progress are bounded below
  that by the guard (`max_concurrent_requests`, guard.py), and their bodies by `body_timeout_s`.
- An accept() that fails for lack of descriptors or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM: asyncio retries a
  second later) closes the EVICT_ON_EXHAUSTED oldest idle connections, so the retry finds a descriptor (a /health
  probe gets in within about a second), and is one WARNING line per ACCEPT_LOG_EVERY_S with the count, not a
  traceback per attempt.

`ServeConfig` carries these limits into `GuardedH11Protocol`, which uvicorn builds once per connection.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from dataclasses import dataclass
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("moeserve.server")

ACCEPT_LOG_EVERY_S = 10.0
EVICT_ON_EXHAUSTED = 8  # idle connections closed when accept() finds no descriptor
_ACCEPT_FAILED = "socket.accept() out of system resource"  # asyncio's message for EMFILE, ENFILE, ENOBUFS, ENOMEM


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    header_timeout_s: float


MAX_AUTO_CONNECTIONS = 4096


def max_connections_choice(setting: int | None, open_files: int, max_concurrent_requests: int) -> tuple[int, str]:
    """(max_connections, why). Unset: 3/4 of the open-file limit (the rest for model files, the tokenizer and the
    process), at most MAX_AUTO_CONNECTIONS; at least max_concurrent_requests + 16, so that some connection is
    always idle to give way to a new one (a /health probe) while every allowed request is in progress."""
    floor = max_concurrent_requests + 16
    if setting is not None:
        return setting, "max_connections, set" + (
            f"; warning: at most {max_concurrent_requests} requests in progress (max_concurrent_requests) may then "
            "hold every connection, and a new client (a /health probe) gets none" if setting < floor else "")
    value = max(floor, min(MAX_AUTO_CONNECTIONS, open_files * 3 // 4))
    return value, (f"3/4 of the open-file limit {open_files} (ulimit -n), at most {MAX_AUTO_CONNECTIONS}, at "
                   f"least max_concurrent_requests + 16" + (
                       "; warning: above the open-file limit, accepts may fail (raise ulimit -n)"
                       if value >= open_files else ""))


def open_file_limit() -> int:
    """The process's soft limit on open descriptors (RLIMIT_NOFILE)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


class ServeConfig(uvicorn.Config):
    """uvicorn.Config with moeserve's connection limits, served by GuardedH11Protocol on asyncio's own event loop:
    uvicorn's default picks uvloop where it is installed (uvicorn[standard], Ray Serve's dependencies), and uvloop
    reports a failed accept() without asyncio's exception-handler call that AcceptErrorLog hangs on, so under EMFILE
    no idle connection was closed and /health never got in again."""

    def __init__(self, app: Any, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(app, http=GuardedH11Protocol, loop="asyncio", **kwargs)
        self.connection_limits = limits


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a head timeout and a cap on open connections (module docstring)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.opened_at = time.monotonic()
        limits: ConnectionLimits = self.config.connection_limits  # type: ignore[attr-defined]
        self._arm_head_timer()
        if len(self.connections) > limits.max_connections:
            victim = _oldest_idle(self.connections, self)
            (victim or self).transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_timer()

    def _arm_head_timer(self) -> None:
        timeout = self.config.connection_limits.header_timeout_s  # type: ignore[attr-defined]
        self.loop.call_later(timeout, self._head_timeout, self.cycle)

    def _head_timeout(self, cycle_then: Any) -> None:
        """No new request head since the timer was armed (`self.cycle` is still what it was then): close."""
        if self.cycle is cycle_then and not self.transport.is_closing():
            self.transport.close()

    def idle(self) -> bool:
        """No request in progress: never had one, or its answer is complete."""
        return self.cycle is None or self.cycle.response_complete


def close_oldest_idle(connections: set[Any], count: int) -> int:
    """Close up to `count` of the oldest idle connections; returns how many."""
    closed = 0
    while closed < count and (victim := _oldest_idle(connections, None)) is not None:
        victim.transport.close()
        closed += 1
    return closed


def _oldest_idle(connections: set[Any], newcomer: Any) -> Any | None:
    idle = [c for c in connections if c is not newcomer and isinstance(c, GuardedH11Protocol) and c.idle()
            and not c.transport.is_closing()]
    return min(idle, key=lambda c: c.opened_at) if idle else None


class AcceptErrorLog:
    """An event loop exception handler: accept() failures counted and logged once per ACCEPT_LOG_EVERY_S without
    a traceback, each calling `on_exhausted` (serve closes idle connections there); anything else goes to the
    loop's default handler."""

    def __init__(self, clock: Any = time.monotonic, on_exhausted: Any = lambda: None) -> None:
        self.clock, self.on_exhausted = clock, on_exhausted
        self.failed = 0  # since the last line
        self.last_line_at: float | None = None

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != _ACCEPT_FAILED:
            loop.default_exception_handler(context)
            return
        self.failed += 1
        self.on_exhausted()
        now = self.clock()
        if self.last_line_at is not None and now - self.last_line_at < ACCEPT_LOG_EVERY_S:
            return
        err = context.get("exception")
        log.warning("cannot accept connections: %s (%d failed accept(s); retrying each second; lower "
                    "max_connections or raise the open-file limit, ulimit -n)",
                    getattr(err, "strerror", None) or err, self.failed)
        self.failed = 0
        self.last_line_at = now
