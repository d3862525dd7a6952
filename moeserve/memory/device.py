"""The device operations a host -> device copier needs, behind one abstract class, so copies and their event
discipline run on CPU with a fake (tests/experts/async_device.py) and on CUDA with `CudaOps`.

The host waits on an event (a staging buffer or host slot about to be refilled, a synchronous copy) with a
blocking wait: CUDA's default event spins a core in `synchronize()`; `CudaOps` records those events with
`blocking=True` (cudaEventBlockingSync), so the waiting thread sleeps and the core stays free for the compute.

`host_buffer` allocates pinned host memory where it can and says why not where it cannot (WSL, some containers,
locked-memory limits): a CUDA copy with ``non_blocking=True`` from pageable memory is unsafe, so callers copy
synchronously from what it gives them then. The expert copier built on these is experts/transfer.py; the
host -> device bandwidth probe is memory/probes.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch


class DeviceOps(ABC):
    """The few device operations a copier needs. `CudaOps` is the real one; tests pass a fake."""

    @abstractmethod
    def empty_pinned(self, nbytes: int) -> torch.Tensor:
        """A new page-locked uint8 host buffer (raises RuntimeError when pinning is unavailable)."""

    @abstractmethod
    def copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> Any:
        """Enqueue dst <- src on the side stream; returns an event that fires when the copy is done."""

    @abstractmethod
    def side_wait(self, event: Any) -> None:
        """Make the side (copy) stream wait for `event` before its next copy."""

    @abstractmethod
    def compute_wait(self, event: Any) -> None:
        """Make the compute stream wait for `event` (a copy) before its next kernel."""

    @abstractmethod
    def compute_event(self) -> Any:
        """An event recorded now on the compute stream (marks: kernels enqueued so far are done when it fires)."""

    @abstractmethod
    def synchronize(self, event: Any) -> None:
        """Block the host until `event` has fired, without spinning a core (the thread sleeps)."""


class CudaOps(DeviceOps):
    """The CUDA streams and events (tests/experts/test_transfer.py runs it against a stand-in of `torch.cuda`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def empty_pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)  # pinned from the start: no 2x transient

    def copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> Any:
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=non_blocking)
            # The host waits on copy events (a buffer to refill): blocking=True makes that wait sleep, not spin.
            event = torch.cuda.Event(blocking=True)
            event.record(self.stream)
        return event

    def side_wait(self, event: Any) -> None:
        self.stream.wait_event(event)

    def compute_wait(self, event: Any) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def compute_event(self) -> Any:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def synchronize(self, event: Any) -> None:
        event.synchronize()


def host_buffer(ops: DeviceOps, nbytes: int) -> tuple[torch.Tensor, str | None]:
    """(a pinned uint8 buffer of `nbytes`, None) or (a pageable one, why pinning failed)."""
    try:
        return ops.empty_pinned(nbytes), None
    except RuntimeError as err:  # torch raises RuntimeError for every pinning failure
        why = str(err).splitlines()[0] if str(err) else type(err).__name__
        return torch.empty(nbytes, dtype=torch.uint8), why
