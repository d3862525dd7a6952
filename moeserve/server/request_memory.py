"""Request memory: what requests hold before the engine has them (their bodies, the parsed request, the prompt's
text and its tokenization, a chat template's output), admitted against a budget that is a line of memory_gb's
split (`request_memory_mb`, engine/sizing.py). Pure policy: no I/O, no torch; the guard (guard.py) asks it.

A request is charged before its body is read: `BYTES_PER_BODY_BYTE` times its Content-Length (a chunked body: the
largest body accepted, max_request_body_mb), plus `BASE_BYTES`. The factor is measured, not guessed: `tokenizers`
holds about 200 bytes per token while it encodes (ids, type ids, token strings, offsets, masks: a 15 MB text of
9.9M tokens peaked at +2.1 GiB, then the list of ids and the JSON answer), and a text can be one token per byte, so
a body byte may cost 200 bytes (tests/server/test_abuse_load.py checks the peak RSS of a server with memory_gb set
under 16 concurrent 15 MB bodies). The charge is held until the answer has been sent.

When the charge does not fit beside what is held now: 503 + Retry-After (it may fit in a moment); when it could
never fit (more than the whole budget): 413.
"""

from __future__ import annotations

from dataclasses import dataclass

BYTES_PER_BODY_BYTE = 200  # peak bytes a request holds per byte of its body (module docstring)
BASE_BYTES = 64 * 1024  # a small request's parse, model and answer


class MemoryRefused(Exception):
    """The request cannot be admitted: `never` when it could not fit in the whole budget (413), else busy (503)."""

    def __init__(self, message: str, never: bool) -> None:
        super().__init__(message)
        self.never = never


@dataclass
class RequestMemory:
    """The budget and what admitted requests hold of it now (one event loop uses it: no lock)."""

    budget_bytes: int
    held_bytes: int = 0
    admitted: int = 0

    @staticmethod
    def cost(body_bytes: int) -> int:
        """Bytes charged for a request whose body has `body_bytes` bytes."""
        return BASE_BYTES + BYTES_PER_BODY_BYTE * body_bytes

    def admit(self, body_bytes: int) -> int:
        """Charge a request; returns the charge (give it back to `release`). Raises MemoryRefused."""
        charge = self.cost(body_bytes)
        if charge > self.budget_bytes:
            raise MemoryRefused(
                f"this request's body ({body_bytes / 1e6:.3g} MB) would take about {charge / 2**20:.0f} MiB to "
                f"parse and tokenize, more than the {self.budget_bytes / 2**20:.0f} MiB all requests may hold "
                "(request_memory_mb); send a smaller request", never=True)
        if self.held_bytes + charge > self.budget_bytes:
            raise MemoryRefused(
                f"the server's request memory is in use ({self.held_bytes / 2**20:.0f} of "
                f"{self.budget_bytes / 2**20:.0f} MiB held by {self.admitted} requests, request_memory_mb); retry "
                "shortly", never=False)
        self.held_bytes += charge
        self.admitted += 1
        return charge

    def release(self, charge: int) -> None:
        self.held_bytes -= charge
        self.admitted -= 1
