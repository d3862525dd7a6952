"""Chat templates rendered under a time and an output-size limit: a checkpoint's template is code the server runs on
every chat request, and jinja's sandbox stops escapes, not work (`{{ 'x' * 2000000000 }}` asks for 2 GB, two nested
`range(100000)` loops for 10^10 steps).

- Size: a string or list repeated (`*`) beyond the output limit is refused before it is built, and the text
  rendered so far is counted as it comes out (`Template.generate`), so no render holds more than the limit.
- Time: a render still running at its deadline gets `TemplateLimitError` raised inside it (CPython's
  per-thread asynchronous exception, checked between bytecodes: a jinja template is Python code, so every loop it
  runs checks). C calls that cannot take long on bounded data (bounded by the size rule) finish first.

Both raise `TemplateLimitError`, whose message names the limit and its setting; the server answers 400.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from jinja2.sandbox import ImmutableSandboxedEnvironment

T = TypeVar("T")


class TemplateLimitError(Exception):
    """A render went past its time or size limit (the message names which, and the setting)."""


@dataclass(frozen=True)
class RenderLimits:
    timeout_s: float
    max_output_chars: int


class LimitedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox with `*` on strings and lists checked against `max_output_chars` (set per environment)."""

    intercepted_binops = frozenset({"*"})
    max_output_chars = 1 << 62

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int) and \
                        len(seq) * times > self.max_output_chars:
                    raise TemplateLimitError(
                        f"the chat template builds a text or list of {len(seq) * times} items, more than the "
                        f"{self.max_output_chars} characters one render may produce (template_max_output_mb)")
        return super().call_binop(context, operator, left, right)


def joined_within(pieces: Iterable[str], max_chars: int) -> str:
    """The pieces joined; raises TemplateLimitError as soon as they pass `max_chars`."""
    out: list[str] = []
    total = 0
    for piece in pieces:
        total += len(piece)
        if total > max_chars:
            raise TemplateLimitError(f"the chat template rendered more than {max_chars} characters, the limit of one "
                                     "render (template_max_output_mb)")
        out.append(piece)
    return "".join(out)


def _raise_in(thread_id: int, exc: type[BaseException] | None) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id),
                                               ctypes.py_object(exc) if exc is not None else None)


class _Deadline(TemplateLimitError):
    pass


def within_time(fn: Callable[[], T], timeout_s: float) -> T:
    """`fn()` on this thread; raises TemplateLimitError if it is still running after `timeout_s`."""
    thread_id = threading.get_ident()
    lock = threading.Lock()
    state = {"running": True, "fired": False}

    def fire() -> None:
        with lock:
            if state["running"]:
                state["fired"] = True
                _raise_in(thread_id, _Deadline)

    timer = threading.Timer(timeout_s, fire)
    timer.daemon = True
    try:
        timer.start()
        try:
            return fn()
        finally:
            timer.cancel()
            with lock:
                state["running"] = False
                if state["fired"]:
                    _raise_in(thread_id, None)  # not delivered yet: withdrawn
    except _Deadline:
        raise TemplateLimitError(f"the chat template took more than {timeout_s:g} s to render "
                                 "(template_timeout_s)") from None
