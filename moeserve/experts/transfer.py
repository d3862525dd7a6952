"""Host -> device copies of expert units: asynchronous only from pinned memory, synchronous otherwise.

A CUDA copy with ``non_blocking=True`` from pageable (unpinned) host memory is undefined behaviour in practice: the
source can be reused before the DMA reads it, and the expert silently holds the next unit's bytes. So the choice
is made once, at start-up:

- pinning works: units are staged in pinned memory and copied on a side stream; an event recorded after each copy
  is what the compute stream waits on before a kernel reads the slot, and what the next reuse of the staging
  buffer waits on. There are two staging buffers (`STAGING_BUFFERS`), so the disk read of one unit overlaps the
  copy of the previous one out of the other buffer;
- pinning fails or is unavailable (WSL, some containers, locked-memory limits): plain synchronous copies, and the
  reason is logged once.

All CUDA calls go through `DeviceOps` (memory/device.py, where the host's waits on events sleep rather than
spin), so the choice and the event discipline are exercised on CPU with a fake.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch

from moeserve.memory.chunks import STAGING_BUFFERS
from moeserve.memory.device import DeviceOps, host_buffer

log = logging.getLogger("moeserve")


@dataclass(frozen=True)
class CopyMode:
    asynchronous: bool
    reason: str


class HostToDevice:
    """Copies units from host buffers into device slots, tracking the events that make reuse safe.

    Per device slot: the event of the last copy INTO it (the compute stream waits on it before use) and the event
    of the compute work that last READ it (the side stream waits on it before overwriting). Per pinned host
    buffer: the event of the last copy FROM it (the host waits on it before refilling that buffer).
    Thread-safe: the compute thread and the prefetch thread both copy (one lock; copies are short to enqueue).
    """

    def __init__(self, ops: DeviceOps, num_slots: int, unit_nbytes: int,
                 staging_buffers: int = STAGING_BUFFERS) -> None:
        self.ops = ops
        self._lock = threading.Lock()
        made = [host_buffer(ops, unit_nbytes) for _ in range(staging_buffers)]
        self.staging = tuple(buffer for buffer, _ in made)  # the read buffers of misses without a host tier
        self._pinned_staging = {buffer.data_ptr() for buffer, why in made if why is None}
        why_not = next((why for _, why in made if why is not None), None)
        if why_not is None:
            self.mode = CopyMode(True, f"{staging_buffers} pinned staging buffers (a read overlaps the previous "
                                 "unit's copy), asynchronous copies on a side stream with events, blocking waits")
        else:
            self.mode = CopyMode(False, f"pinned memory unavailable ({why_not}): synchronous copies")
        self._filled: list[Any] = [None] * num_slots  # event of the last copy into each slot
        self._read: list[Any] = [None] * num_slots  # compute-stream event after the last use of each slot
        self._source_busy: dict[int, Any] = {}  # data_ptr of a pinned source -> event of its last copy

    def is_pinned_staging(self, src: torch.Tensor) -> bool:
        """`src` is one of the staging buffers and pinning it worked."""
        return src.data_ptr() in self._pinned_staging

    def wait_source_free(self, src: torch.Tensor) -> None:
        """Block until no copy from `src` (pinned host buffer) is in flight: call before refilling it."""
        with self._lock:
            event = self._source_busy.pop(src.data_ptr(), None)
        if event is not None:
            self.ops.synchronize(event)

    def copy_in(self, slot: int, dst: torch.Tensor, src: torch.Tensor, src_pinned: bool) -> None:
        """dst (device slot `slot`) <- src (host). Asynchronous only when `src` is pinned and pinning works."""
        asynchronous = self.mode.asynchronous and src_pinned
        with self._lock:
            released = self._read[slot]
            if released is not None:
                self.ops.side_wait(released)  # the kernels that read the old unit must finish first
                self._read[slot] = None
            event = self.ops.copy(dst, src, non_blocking=asynchronous)
            if asynchronous:
                self._filled[slot] = event
                self._source_busy[src.data_ptr()] = event
            else:
                self.ops.synchronize(event)
                self._filled[slot] = None

    def before_use(self, slot: int) -> None:
        """Called by the compute thread before kernels read `slot`."""
        with self._lock:
            event = self._filled[slot]
            self._filled[slot] = None
        if event is not None:
            self.ops.compute_wait(event)

    def after_use(self, slots: list[int]) -> None:
        """Called by the compute thread when the kernels reading `slots` are enqueued (the pins are released)."""
        event = self.ops.compute_event()
        with self._lock:
            for slot in slots:
                self._read[slot] = event
