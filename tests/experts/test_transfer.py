"""The pinned / unpinned transfer choice and its event discipline, exercised on CPU with a fake DeviceOps.

The fake records every call. The rules checked: non_blocking copies only ever come from pinned buffers; when
pinning fails, every copy is synchronous and the reason is reported once; the compute stream waits for a slot's
copy before using it; the side stream waits for the compute work that last read a slot before overwriting it;
a pinned staging buffer is not refilled while a copy from it may be in flight.
"""

from __future__ import annotations

import pytest
import torch

from moeserve.experts.store import ExpertStore, StoreOptions
from moeserve.experts.transfer import HostToDevice
from moeserve.memory.device import DeviceOps
from tests.experts.test_store import WIDTH, FakeSource, use


class FakeOps(DeviceOps):
    def __init__(self, can_pin: bool) -> None:
        self.can_pin = can_pin
        self.pinned_ptrs: set[int] = set()
        self.calls: list[tuple] = []
        self._events = 0

    def _event(self) -> str:
        self._events += 1
        return f"ev{self._events}"

    def empty_pinned(self, nbytes):
        if not self.can_pin:
            raise RuntimeError("cudaHostRegister failed: operation not supported (WSL)\nmore detail")
        out = torch.empty(nbytes, dtype=torch.uint8)
        self.pinned_ptrs.add(out.data_ptr())
        return out

    def copy(self, dst, src, non_blocking):
        dst.copy_(src)
        event = self._event()
        self.calls.append(("copy", non_blocking, src.data_ptr() in self.pinned_ptrs or self._in_pinned(src), event))
        return event

    def _in_pinned(self, src) -> bool:  # a row of a pinned pool
        return any(p <= src.data_ptr() < p + (1 << 20) for p in self.pinned_ptrs)

    def side_wait(self, event):
        self.calls.append(("side_wait", event))

    def compute_wait(self, event):
        self.calls.append(("compute_wait", event))

    def compute_event(self):
        event = self._event()
        self.calls.append(("compute_event", event))
        return event

    def synchronize(self, event):
        self.calls.append(("synchronize", event))


def store_with(ops: FakeOps, capacity: int = 2, host_capacity: int = 0) -> ExpertStore:
    opts = StoreOptions(policy="lru", host_capacity=host_capacity, ops=ops)
    return ExpertStore(FakeSource(), [0, 1], 8, capacity, torch.device("cpu"), options=opts)  # type: ignore[arg-type]


def test_pinning_available_selects_async_copies_from_pinned_staging():
    ops = FakeOps(can_pin=True)
    store = store_with(ops)
    assert store.copier is not None and store.copier.mode.asynchronous
    use(store, 0, [0, 1])
    use(store, 0, [2])  # evicts one: a third read, into the first staging buffer again
    copies = [c for c in ops.calls if c[0] == "copy"]
    assert len(copies) == 3 and all(non_blocking and pinned for _, non_blocking, pinned, _ in copies)
    # Each slot's copy event is waited on by the compute stream before the chunk is used.
    waited = {c[1] for c in ops.calls if c[0] == "compute_wait"}
    assert waited == {c[3] for c in copies}
    # Two staging buffers taken in turn: the second unit was read while the first one's copy was in flight (no
    # wait for it), the third refilled the first buffer only after the first copy from it had completed.
    synced = [c[1] for c in ops.calls if c[0] == "synchronize"]
    assert synced == [copies[0][3]]
    assert ops.calls.index(copies[1]) < ops.calls.index(("synchronize", copies[0][3])) < ops.calls.index(copies[2])


def test_pinning_unavailable_selects_synchronous_copies_and_says_why_once():
    ops = FakeOps(can_pin=False)
    store = store_with(ops, host_capacity=4)
    assert store.copier is not None and not store.copier.mode.asynchronous
    assert "pinned memory unavailable (cudaHostRegister failed" in store.copier.mode.reason
    assert "\n" not in store.copier.mode.reason
    assert "pageable" in store.describe()
    use(store, 0, [0, 1])
    use(store, 0, [2, 3])
    use(store, 0, [0])  # served from the (pageable) host tier
    copies = [c for c in ops.calls if c[0] == "copy"]
    assert len(copies) == 5 and not any(non_blocking for _, non_blocking, _, _ in copies)
    assert not any(c[0] == "compute_wait" for c in ops.calls)  # synchronous: nothing to wait for


def test_pinned_host_tier_copies_async_and_a_slot_is_overwritten_only_after_its_readers():
    ops = FakeOps(can_pin=True)
    store = store_with(ops, capacity=1, host_capacity=4)
    use(store, 0, [0])  # slot 0 <- expert 0; its readers' event is recorded when the chunk is released
    released = [c[1] for c in ops.calls if c[0] == "compute_event"]
    use(store, 0, [1])  # evicts expert 0: the side stream must wait for those readers first
    second_copy = [c for c in ops.calls if c[0] == "copy"][1]
    assert ops.calls.index(("side_wait", released[0])) < ops.calls.index(second_copy)
    assert second_copy[1] and second_copy[2]  # async, from a pinned host slot
    assert store.stats.layer(0).bytes_from_disk == 2 * WIDTH * 4


def test_host_to_device_never_passes_non_blocking_for_pageable_sources():
    ops = FakeOps(can_pin=True)
    copier = HostToDevice(ops, num_slots=2, unit_nbytes=64)
    pageable = torch.zeros(64, dtype=torch.uint8)
    copier.copy_in(0, torch.empty(64, dtype=torch.uint8), pageable, src_pinned=False)
    copier.copy_in(1, torch.empty(64, dtype=torch.uint8), copier.staging[0], src_pinned=True)
    copies = [c for c in ops.calls if c[0] == "copy"]
    assert [c[1] for c in copies] == [False, True]


class StandInEvent:
    made: list[StandInEvent] = []

    def __init__(self, blocking: bool = False) -> None:
        self.blocking = blocking
        self.recorded_on: object = None
        self.synchronized = 0
        StandInEvent.made.append(self)

    def record(self, stream: object) -> None:
        self.recorded_on = stream

    def synchronize(self) -> None:
        self.synchronized += 1


class StandInStream:
    def __init__(self, device: object = None) -> None:
        self.waited: list[object] = []

    def wait_event(self, event: object) -> None:
        self.waited.append(event)


def test_cuda_ops_record_copy_events_the_host_waits_on_without_spinning(monkeypatch):
    # CudaOps against a stand-in of torch.cuda's Stream / Event / stream(): the calls it makes, on CPU tensors.
    import contextlib

    from moeserve.memory.device import CudaOps

    current = StandInStream()
    StandInEvent.made = []
    monkeypatch.setattr(torch.cuda, "Stream", StandInStream)
    monkeypatch.setattr(torch.cuda, "Event", StandInEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    ops = CudaOps(torch.device("cuda", 0))
    src, dst = torch.arange(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)
    event = ops.copy(dst, src, non_blocking=True)
    assert torch.equal(dst, src) and event.recorded_on is ops.stream
    assert event.blocking  # cudaEventBlockingSync: synchronize() sleeps instead of spinning a core
    ops.synchronize(event)
    assert event.synchronized == 1
    ops.side_wait(event)
    ops.compute_wait(event)
    assert ops.stream.waited == [event] and current.waited == [event]
    readers = ops.compute_event()
    assert readers.recorded_on is current and not readers.blocking  # only ever waited on by a stream
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError):  # no CUDA: pinning fails, and host_buffer falls back to pageable
            ops.empty_pinned(64)
