"""Pinned memory that cannot blow up: power-of-two chunks of whole units (pure planning, tested without torch's
allocator), pinning that fails part-way logged and falling back per chunk, copies from each chunk asynchronous
only where it is pinned (on the asynchronous fake fast tier), and the chunks released on close."""

from __future__ import annotations

import functools
import logging
import random

import pytest
import torch

from moeserve.experts import tiers
from moeserve.experts.store import ExpertStore, StoreOptions
from moeserve.experts.tiers import HostTier, Loader, Tier
from moeserve.experts.transfer import HostToDevice
from moeserve.memory.chunks import (
    CHUNK_BYTES,
    MAX_CHUNK_BYTES,
    capacity_within,
    chunk_size,
    next_pow2,
    plan_chunks,
)
from moeserve.memory.pinned import ChunkedHostPool
from tests.experts.async_device import AsyncFakeOps
from tests.experts.test_async_fast_tier import LAYERS, NUM_EXPERTS, UNIT_BYTES, PatternSource

MiB = 2**20


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def test_next_pow2():
    assert [next_pow2(n) for n in (0, 1, 2, 3, 4, 5, 1023, 1024, 1025)] == [1, 1, 2, 4, 4, 8, 1024, 1024, 2048]


@pytest.mark.parametrize("seed", range(4))
def test_random_plans_are_powers_of_two_of_whole_units(seed):
    rng = random.Random(seed)
    for _ in range(200):
        unit = rng.choice([rng.randrange(1, 4096), rng.randrange(1 * MiB, 80 * MiB), rng.randrange(256, 1500) * MiB])
        capacity = rng.randrange(1, 5000)
        plan = plan_chunks(capacity, unit)
        assert plan.capacity == capacity
        assert all(is_pow2(n) for n in plan.chunk_nbytes)  # nothing for torch's pinned allocator to round up
        assert all(units * unit <= n for units, n in zip(plan.units, plan.chunk_nbytes, strict=True))
        assert all(n <= max(MAX_CHUNK_BYTES, next_pow2(unit)) for n in plan.chunk_nbytes)
        assert plan.nbytes == sum(plan.chunk_nbytes) >= capacity * unit
        budget = rng.randrange(0, 2 * plan.nbytes + 1)
        fits = capacity_within(budget, unit, capacity)
        assert plan_chunks(fits, unit).nbytes <= budget  # the slack is counted against the budget
        assert fits == capacity or plan_chunks(fits + 1, unit).nbytes > budget  # and the most that fit


def test_the_chunk_size_wastes_least():
    assert chunk_size(64 * MiB) == CHUNK_BYTES  # 4 units, no slack
    assert chunk_size(100 * MiB) == 512 * MiB  # 5 units, 12 MiB slack (256 MiB would waste 56)
    assert chunk_size(300 * MiB) == 1024 * MiB  # 3 units, 124 MiB slack (512 MiB would hold one, 212 slack)
    assert chunk_size(1500 * MiB) == 2048 * MiB  # one unit bigger than the largest chunk: the next power of two


def test_the_last_chunk_is_only_as_big_as_its_units_need():
    plan = plan_chunks(10, 64 * MiB)
    assert plan.units == (4, 4, 2) and plan.chunk_nbytes == (256 * MiB, 256 * MiB, 128 * MiB)
    assert plan.describe() == "3 chunks (2 x 256.0 MiB, 1 x 128.0 MiB; 0.0 MiB slack)"
    assert plan_chunks(0, 64 * MiB).nbytes == 0


def counting_pin(ok_chunks: int, made: list[torch.Tensor]):  # noqa: ANN201
    """A pin function that succeeds `ok_chunks` times, then fails as cudaHostAlloc under a locked-memory limit."""
    def pin(nbytes: int) -> torch.Tensor:
        if len(made) >= ok_chunks:
            raise RuntimeError("CUDA error: out of memory (locked-memory limit)\nCUDA kernel errors might be ...")
        made.append(torch.zeros(nbytes, dtype=torch.uint8))
        return made[-1]
    return pin


def test_a_failure_part_way_is_logged_and_the_rest_is_pageable(caplog):
    made: list[torch.Tensor] = []
    released: list[int] = []
    plan = plan_chunks(12, 1024, chunk_bytes=4096)  # 3 chunks of 4 units
    assert plan.chunk_nbytes == (4096, 4096, 4096)
    with caplog.at_level(logging.WARNING, logger="moeserve"):
        pool = ChunkedHostPool(plan, counting_pin(1, made), release=lambda: released.append(1))
    assert pool.chunk_pinned == [True, False, False] and pool.pinned_bytes == 4096 and not pool.all_pinned
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning == ("host tier: pinning chunk 2 of 3 (0.0 MiB) failed (CUDA error: out of memory (locked-memory "
                       "limit)): it and the 1 after it are pageable, and their copies to the GPU synchronous")
    assert len(made) == 1  # no further attempt after the first failure
    assert [pool.is_pinned(s) for s in pool.slots] == [True] * 4 + [False] * 8
    assert pool.is_pinned(torch.zeros(4)) is None
    assert all(s.numel() == 1024 for s in pool.slots)
    assert len({s.data_ptr() for s in pool.slots}) == 12  # no slot overlaps another
    assert "pinned + " in pool.describe() and "pinning failed: CUDA error" in pool.describe()
    pool.close()
    assert released == [1] and pool.slots == [] and pool.chunks == []
    assert pool.nbytes == 3 * 4096 and pool.chunk_pinned == [True, False, False]  # the figures stay for the log
    pool.close()
    assert released == [1]  # once


def test_all_pinned_and_nothing_to_pin():
    made: list[torch.Tensor] = []
    released: list[int] = []
    pool = ChunkedHostPool(plan_chunks(5, 1000), counting_pin(99, made), release=lambda: released.append(1))
    # 5 units of 1000 bytes: 4 KiB (4 units) + 1 KiB (1 unit), not one 8 KiB chunk with 3 KiB of slack
    assert pool.all_pinned and pool.nbytes == 5120 and len(pool.chunks) == 2
    assert pool.describe() == "0.0 MiB pinned in 2 chunks (1 x 0.0 MiB, 1 x 0.0 MiB; 0.0 MiB slack)"
    cpu = ChunkedHostPool(plan_chunks(5, 1000), None, release=lambda: released.append(2))
    assert cpu.pinned_bytes == 0 and "(no device to copy to)" in cpu.describe()
    cpu.close()
    pool.close()
    assert released == [1]  # a pool with nothing pinned has nothing to give back


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("broken", [False, True])
def test_mixed_chunks_through_the_loader_on_the_async_fake(monkeypatch, caplog, seed, broken):
    """The real HostTier and Loader on the asynchronous fake fast tier: pinning fails after the first chunk, so
    copies out of it are asynchronous and those out of the others blocking (a non_blocking copy from pageable
    memory would be a violation); every device slot ends up with its unit's bytes, through evictions too.
    `broken`: a host tier that says every slot is pinned (one flag for the whole tier, as before the chunks) makes
    the fake record non_blocking copies from pageable memory: the check can fail."""
    if broken:
        monkeypatch.setattr(HostTier, "is_pinned", lambda self, t: True)
    monkeypatch.setattr(tiers, "plan_chunks", functools.partial(plan_chunks, chunk_bytes=4 * UNIT_BYTES))
    ops = AsyncFakeOps(seed)
    try:
        num_slots = 6
        copier = HostToDevice(ops, num_slots, UNIT_BYTES)
        real_pin, pinned_chunks = ops.empty_pinned, []

        def pin_one_chunk(nbytes: int) -> torch.Tensor:  # the fake's own pinning, refused after one chunk
            if pinned_chunks:
                raise RuntimeError("fake: locked-memory limit reached")
            pinned_chunks.append(nbytes)
            return real_pin(nbytes)

        monkeypatch.setattr(ops, "empty_pinned", pin_one_chunk)
        with caplog.at_level(logging.WARNING, logger="moeserve"):
            host = HostTier(12, UNIT_BYTES, copier)
        assert host.pool.chunk_pinned == [True, False, False] and not host.pinned
        assert any("pinning chunk 2 of 3" in r.getMessage() for r in caplog.records)
        source = PatternSource(seed)
        loader = Loader(source, torch.device("cpu"), copier, host, verify=False)
        device = torch.zeros(num_slots, UNIT_BYTES, dtype=torch.uint8)
        rng = random.Random(seed)
        keys = [(layer, e) for layer in LAYERS[:2] for e in range(NUM_EXPERTS)]  # 16 units > 12 host slots
        tiers_seen = set()
        for step in range(60):
            key, slot = rng.choice(keys), step % num_slots
            copier.before_use(slot)  # as the store lends the slot
            ops.launch(lambda: None)
            copier.after_use([slot])
            tiers_seen.add(loader.load(key, slot, device[slot]))
            copier.before_use(slot)
            ops.synchronize_compute()
            assert torch.equal(device[slot], source.units[key]), (step, key)
            copier.after_use([slot])
        assert tiers_seen == {Tier.HOST, Tier.DISK} and host.evictions > 0
        if broken:
            assert ops.violations and ops.sync_copies == 0
            return
        assert ops.violations == [] and ops.async_copies > 0 and ops.sync_copies > 0
    finally:
        ops.close()


def test_the_store_closes_its_host_tier():
    ops = AsyncFakeOps(0)
    try:
        opts = StoreOptions(policy="lru", host_capacity=8, ops=ops)
        store = ExpertStore(PatternSource(0), LAYERS, NUM_EXPERTS, 4, torch.device("cpu"), options=opts)
        host = store.loader.host
        assert host is not None and host.pinned and len(host.pool.slots) == 8
        assert "host tier 8 experts" in store.describe()
        store.close()
        assert host.pool.chunks == [] and host.pool.slots == []
    finally:
        ops.close()


def test_leftover_units_do_not_round_up_to_a_chunk_twice_their_size():
    # seen on an H200: 10 units of 60 MiB planned as one 1 GiB chunk (424 MiB of slack)
    plan = plan_chunks(10, 60 * MiB)
    assert plan.units == (8, 2) and plan.chunk_nbytes == (512 * MiB, 128 * MiB)
    for unit in (60 * MiB, 7 * MiB + 3, 300 * MiB, 1000):
        for capacity in range(1, 60):
            plan = plan_chunks(capacity, unit)
            # each chunk wastes at most an eighth of itself, or holds one unit, or is the full-chunk size
            for n, size in zip(plan.units, plan.chunk_nbytes, strict=True):
                assert size - n * unit <= size // 8 or n == 1 or size == plan.chunk_nbytes[0]
