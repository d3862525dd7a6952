"""The asynchronous fake fast tier itself (tests/experts/async_device.py) behaves as CUDA streams do, so that the
store tests on it mean something. "late" streams make each case deterministic: their work runs only once waited for.
"""

from __future__ import annotations

import pytest
import torch

from tests.experts.async_device import AsyncFakeOps


@pytest.fixture
def late_copies():
    ops = AsyncFakeOps(0, copies="late", kernels="random")
    yield ops
    ops.close()


@pytest.fixture
def late_kernels():
    ops = AsyncFakeOps(0, copies="random", kernels="late")
    yield ops
    ops.close()


def test_an_asynchronous_copy_reads_its_source_when_the_stream_gets_there(late_copies):
    ops = late_copies
    src, dst = ops.empty_pinned(4), torch.zeros(4, dtype=torch.uint8)
    src.fill_(1)
    event = ops.copy(dst, src, non_blocking=True)
    src.fill_(2)  # refilled without waiting for the copy
    assert torch.equal(dst, torch.zeros(4, dtype=torch.uint8))  # nothing waited yet: not run
    ops.synchronize(event)
    assert torch.equal(dst, torch.full((4,), 2, dtype=torch.uint8))  # the copy saw the refill


def test_a_blocking_copy_has_run_when_it_returns(late_copies):
    ops = late_copies
    dst = torch.zeros(4, dtype=torch.uint8)
    ops.copy(dst, torch.full((4,), 7, dtype=torch.uint8), non_blocking=False)
    assert torch.equal(dst, torch.full((4,), 7, dtype=torch.uint8))
    assert (ops.sync_copies, ops.async_copies, ops.violations) == (1, 0, [])


def test_a_kernel_after_compute_wait_sees_the_copy_and_one_without_does_not(late_copies):
    ops = late_copies
    src, slot = ops.empty_pinned(4), torch.zeros(4, dtype=torch.uint8)
    src.fill_(5)
    seen: list[int] = []
    ops.launch(lambda: seen.append(int(slot[0])))  # no wait: runs before the (late) copy
    event = ops.copy(slot, src, non_blocking=True)
    ops.launch(lambda: seen.append(int(slot[0])))  # still no wait
    ops.compute_wait(event)
    ops.launch(lambda: seen.append(int(slot[0])))
    ops.synchronize_compute()
    assert seen == [0, 0, 5]


def test_a_copy_after_side_wait_runs_after_the_kernels_before_the_event(late_kernels):
    ops = late_kernels
    slot = torch.full((4,), 3, dtype=torch.uint8)
    seen: list[int] = []
    ops.launch(lambda: seen.append(int(slot[0])))
    ops.side_wait(ops.compute_event())
    ops.synchronize(ops.copy(slot, ops.empty_pinned(4).fill_(9), non_blocking=True))
    ops.launch(lambda: seen.append(int(slot[0])))  # after the event: free to run after the copy
    ops.synchronize_compute()
    assert seen == [3, 9]


def test_without_side_wait_a_copy_overwrites_a_slot_before_its_kernels_read_it(late_kernels):
    ops = late_kernels
    slot = torch.full((4,), 3, dtype=torch.uint8)
    seen: list[int] = []
    ops.launch(lambda: seen.append(int(slot[0])))
    ops.synchronize(ops.copy(slot, ops.empty_pinned(4).fill_(9), non_blocking=True))
    ops.synchronize_compute()
    assert seen == [9]


def test_events_fire_in_stream_order(late_copies):
    ops = late_copies
    dsts = [torch.zeros(1, dtype=torch.uint8) for _ in range(3)]
    events = [ops.copy(d, ops.empty_pinned(1).fill_(n + 1), non_blocking=True) for n, d in enumerate(dsts)]
    ops.synchronize(events[1])
    assert [int(d[0]) for d in dsts] == [1, 2, 0]  # the earlier copy ran too, the later one not yet
    ops.synchronize(events[2])
    assert [int(d[0]) for d in dsts] == [1, 2, 3]


def test_non_blocking_from_pageable_memory_is_a_violation_and_pinning_can_be_refused():
    ops = AsyncFakeOps(0, pin_limit_bytes=8)
    try:
        pinned = ops.empty_pinned(8)
        with pytest.raises(RuntimeError, match="cannot pin 9 bytes"):
            ops.empty_pinned(9)
        ops.synchronize(ops.copy(torch.empty(8, dtype=torch.uint8), pinned, non_blocking=True))
        assert ops.violations == [] and ops.is_pinned(pinned[2:6])
        ops.synchronize(ops.copy(torch.empty(8, dtype=torch.uint8), torch.ones(8, dtype=torch.uint8), True))
        assert len(ops.violations) == 1 and "pageable" in ops.violations[0]
    finally:
        ops.close()


def test_a_failing_kernel_is_recorded_and_the_stream_goes_on(late_kernels):
    ops = late_kernels
    ran: list[bool] = []
    ops.launch(lambda: 1 / 0)
    ops.launch(lambda: ran.append(True))
    ops.synchronize_compute()
    assert ran == [True] and len(ops.errors) == 1 and "ZeroDivisionError" in ops.errors[0]
