"""An asynchronous fake fast tier: the CUDA semantics the expert store relies on, run by threads on CPU memory.

`AsyncFakeOps` implements `DeviceOps` (memory/device.py), the one seam through which the store, its loader,
host tier and copier touch a device. Its two streams are worker threads that run their work in order, each item
after a random delay (or, for a "late" stream, only once something waits for it), so:

- a copy reads its source when the copy stream reaches it, not when it is enqueued: a host buffer refilled before
  the copy's event fired gives the slot the next unit's bytes;
- a "kernel" (`launch`: a function the test's fake model runs on the compute stream) reads slot contents when the
  compute stream reaches it: a slot overwritten before the kernels that read it ran, or read before its copy
  landed, gives wrong data;
- an event fires when its stream has run everything enqueued before it was recorded; `synchronize` blocks the
  host on it, `side_wait` / `compute_wait` make a stream wait for it (in CUDA: `stream.wait_event`);
- a blocking copy (`non_blocking=False`) returns once it has run, as torch's `copy_` does on CUDA (it synchronizes
  the stream it was enqueued on); a `non_blocking` copy from a buffer that `empty_pinned` did not make is recorded
  in `violations` (undefined behaviour on CUDA) and read late like any other.

With `kernels="host"` the compute stream is the calling thread itself, as for a whole model on CPU whose ops run
where they are called: `compute_wait` blocks the caller until the copy's event fires (the copy stream still runs
late or after random delays), `launch` runs a kernel at once, and a compute event has always fired.

Pinning can be refused above `pin_limit_bytes` (0: never), as on WSL or under a locked-memory limit.
What it does not model: torch ops the store runs on device tensors itself (the resident store's NaN check reads
the pool on the calling thread here, on the compute stream on CUDA), and caching-allocator reuse.
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from moeserve.memory.device import DeviceOps

Timing = Literal["random", "late"]  # random: each item after a random delay; late: only once something waits
KernelTiming = Literal["random", "late", "host"]  # host: kernels run on the calling thread (module docstring)
WAIT_LIMIT_S = 60.0  # a wait this long is a deadlock in the fake or the store: raise rather than hang the test


class FakeStream:
    """A FIFO of work run in order by one thread. Positions count items: position n = the first n items."""

    def __init__(self, name: str, rng: random.Random, timing: Timing, max_delay_s: float,
                 errors: list[str]) -> None:
        self.name = name
        self._rng = rng  # drawn by the worker thread only
        self._timing = timing
        self._max_delay_s = max_delay_s
        self._errors = errors
        self._cond = threading.Condition()
        self._items: deque[Callable[[], object]] = deque()
        self.enqueued = 0  # items ever enqueued
        self.done = 0  # items run (always a prefix of the enqueued ones)
        self._demanded = 0  # a late stream runs items up to this position
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"fake-{name}-stream", daemon=True)
        self._thread.start()

    def enqueue(self, work: Callable[[], object]) -> int:
        """Append `work`; returns the position that includes it (an event recorded right after it)."""
        with self._cond:
            self._items.append(work)
            self.enqueued += 1
            self._cond.notify_all()
            return self.enqueued

    def position(self) -> int:
        """The position of everything enqueued so far (where an event recorded now sits)."""
        with self._cond:
            return self.enqueued

    def wait_until(self, position: int) -> None:
        """Block until the first `position` items have run (and make a late stream run them)."""
        with self._cond:
            self._demanded = max(self._demanded, position)
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: self.done >= position or self._closed, WAIT_LIMIT_S):
                raise TimeoutError(f"fake {self.name} stream: position {position} not reached "
                                   f"in {WAIT_LIMIT_S:.0f} s (done {self.done} of {self.enqueued})")

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=WAIT_LIMIT_S)

    def _ready(self) -> bool:
        return self._closed or (bool(self._items) and (self._timing == "random" or self._demanded > self.done))

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(self._ready)
                if self._closed:
                    return
                work = self._items[0]
            if self._timing == "random" and self._rng.random() < 0.5:
                time.sleep(self._rng.uniform(0.0, self._max_delay_s))  # reorders this stream against the rest
            try:
                work()
            except Exception as err:  # recorded for the test; the stream goes on like a device would
                self._errors.append(f"{self.name} stream: {type(err).__name__}: {err}")
            with self._cond:
                self._items.popleft()
                self.done += 1
                self._cond.notify_all()


@dataclass(frozen=True)
class FakeEvent:
    """Fires once `stream` has run its first `position` items."""

    stream: FakeStream
    position: int

    def wait(self) -> None:
        self.stream.wait_until(self.position)


class AsyncFakeOps(DeviceOps):
    """A copy stream and a compute stream run by threads; see the module docstring. `close()` when done."""

    def __init__(self, seed: int, copies: Timing = "random", kernels: KernelTiming = "random",
                 max_delay_s: float = 0.001, pin_limit_bytes: int | None = None) -> None:
        self.host_compute = kernels == "host"
        self.errors: list[str] = []  # exceptions raised by stream work (kernels, waits)
        self.violations: list[str] = []  # non_blocking copies from pageable memory
        self.async_copies = self.sync_copies = 0
        self.pin_limit_bytes = pin_limit_bytes
        self._pinned: list[tuple[int, int]] = []  # [start, end) of every buffer empty_pinned made
        self._keep: list[torch.Tensor] = []  # those buffers, so their addresses are never reused
        self.copy_stream = FakeStream("copy", random.Random(f"{seed}-copy"), copies, max_delay_s, self.errors)
        self.compute_stream = FakeStream("compute", random.Random(f"{seed}-compute"),
                                         "random" if kernels == "host" else kernels, max_delay_s, self.errors)

    # ------------------------------------------------------------------------------------- DeviceOps
    def empty_pinned(self, nbytes: int) -> torch.Tensor:
        if self.pin_limit_bytes is not None and nbytes > self.pin_limit_bytes:
            raise RuntimeError(f"fake: cannot pin {nbytes} bytes (limit {self.pin_limit_bytes})\nmore detail")
        out = torch.zeros(nbytes, dtype=torch.uint8)
        self._pinned.append((out.data_ptr(), out.data_ptr() + nbytes))
        self._keep.append(out)
        return out

    def copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> FakeEvent:
        if non_blocking and not self.is_pinned(src):
            self.violations.append(f"non_blocking copy from pageable memory at {src.data_ptr():#x}")
        position = self.copy_stream.enqueue(lambda: dst.copy_(src))  # reads src when the stream gets there
        event = FakeEvent(self.copy_stream, position)
        if non_blocking:
            self.async_copies += 1
        else:
            self.sync_copies += 1
            event.wait()  # torch synchronizes the stream after a blocking copy
        return event

    def side_wait(self, event: FakeEvent) -> None:
        self.copy_stream.enqueue(event.wait)

    def compute_wait(self, event: FakeEvent) -> None:
        if self.host_compute:
            event.wait()  # the caller is the compute stream: its next "kernel" runs after this returns
        else:
            self.compute_stream.enqueue(event.wait)

    def compute_event(self) -> FakeEvent:
        return FakeEvent(self.compute_stream, self.compute_stream.position())

    def synchronize(self, event: FakeEvent) -> None:
        event.wait()

    # ------------------------------------------------------------------------------- for the tests
    def is_pinned(self, t: torch.Tensor) -> bool:
        """`t` lies inside a buffer that `empty_pinned` made."""
        start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        return any(lo <= start and end <= hi for lo, hi in self._pinned)

    def launch(self, kernel: Callable[[], None]) -> None:
        """Enqueue a "kernel" on the compute stream (what the MoE layer's ops are on CUDA); run it now on the
        calling thread with `kernels="host"`."""
        if self.host_compute:
            kernel()
        else:
            self.compute_stream.enqueue(kernel)

    def synchronize_compute(self) -> None:
        """Block until every kernel launched so far has run (on CUDA: a `.cpu()` of the step's logits)."""
        self.compute_stream.wait_until(self.compute_stream.position())

    def close(self) -> None:
        self.copy_stream.close()
        self.compute_stream.close()
