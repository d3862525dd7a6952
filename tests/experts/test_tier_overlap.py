"""Overlap in the loader (experts/tiers.py, experts/transfer.py), shown on the asynchronous fake fast tier:

- the read of unit N+1 runs while the copy of unit N is still in flight (two staging buffers, taken in turn);
- no lock is held across a disk read: two loads read at the same time (the host tier and the staging buffers
  alike);
- a load that finds every host slot busy passes through a staging buffer; a failed read leaves nothing mapped.
Each would fail without the overlap: with one staging buffer (or a lock across the read), the second read waits.
"""

from __future__ import annotations

import threading

import pytest
import torch

from moeserve.errors import ExpertLoadError, MoeserveError
from moeserve.experts.store import ExpertStore, StoreOptions
from moeserve.experts.tiers import HostTier, Loader, Tier
from moeserve.experts.transfer import HostToDevice
from tests.experts.async_device import AsyncFakeOps
from tests.experts.test_async_fast_tier import LAYERS, NUM_EXPERTS, UNIT_BYTES, PatternSource

BARRIER_TIMEOUT_S = 30.0  # a read that never meets the other one: the loads were serialized


class RecordingSource(PatternSource):
    """Records, at each read, how many copies the fake copy stream had been given and had run."""

    def __init__(self, ops: AsyncFakeOps, seed: int = 0) -> None:
        super().__init__(seed)
        self.ops = ops
        self.at_read: list[tuple[int, int]] = []  # (copies enqueued, copies run) when each read began

    def read_unit(self, layer: int, expert: int, unit_bytes: torch.Tensor) -> None:
        stream = self.ops.copy_stream
        self.at_read.append((stream.enqueued, stream.done))
        super().read_unit(layer, expert, unit_bytes)


class MeetingSource(PatternSource):
    """Every read waits until `parties` reads are in progress at once (a barrier): loads serialized by a lock
    never meet, and the barrier breaks."""

    def __init__(self, parties: int, seed: int = 0) -> None:
        super().__init__(seed)
        self.barrier = threading.Barrier(parties, timeout=BARRIER_TIMEOUT_S)

    def read_unit(self, layer: int, expert: int, unit_bytes: torch.Tensor) -> None:
        self.barrier.wait()
        super().read_unit(layer, expert, unit_bytes)


def make_store(source: PatternSource, ops: AsyncFakeOps, capacity: int = 8, host: int = 0,
               io_threads: int = 0) -> ExpertStore:
    opts = StoreOptions(policy="lru", host_capacity=host, ops=ops, io_threads=io_threads)
    return ExpertStore(source, LAYERS, NUM_EXPERTS, capacity, torch.device("cpu"), options=opts)


def consume(store: ExpertStore, ops: AsyncFakeOps, layer: int, ids: list[int], source: PatternSource) -> None:
    """Ask for `ids` and check every unit's bytes on the compute stream, as a model's kernels would."""
    wrong: list[int] = []
    for chunk in store.experts(layer, ids):
        for e, (unit,) in chunk:
            expected = source.units[(layer, e)]
            ops.launch(lambda u=unit, x=expected, e=e: None if torch.equal(u, x) else wrong.append(e))
    ops.synchronize_compute()
    assert wrong == []


def test_the_read_of_the_next_unit_overlaps_the_copy_of_the_previous():
    # Copies run late (only when something waits for them): a read that had to wait for the previous copy would
    # see it run; with two staging buffers the second read starts while the first copy has not run.
    ops = AsyncFakeOps(0, copies="late", kernels="late")
    source = RecordingSource(ops)
    store = make_store(source, ops)
    try:
        assert store.copier is not None and len(store.copier.staging) == 2
        consume(store, ops, 0, [0, 1, 2, 3], source)
        assert source.at_read[0] == (0, 0)
        assert source.at_read[1] == (1, 0)  # unit 1 read while unit 0's copy is still in flight
        enqueued, done = source.at_read[2]  # unit 2 reuses unit 0's buffer: that copy (only) has run
        assert enqueued == 2 and done >= 1
    finally:
        store.close()
        ops.close()


@pytest.mark.parametrize("host", [0, 12])
def test_no_lock_is_held_across_a_disk_read(host: int):
    # Two I/O threads + the compute thread read one chunk's misses: with a lock across the read, the barrier of
    # two would never be met and every load would fail.
    ops = AsyncFakeOps(1)
    source = MeetingSource(parties=2)
    store = make_store(source, ops, host=host, io_threads=2)
    try:
        consume(store, ops, 0, [0, 1, 2, 3], source)
        assert store.stats.misses == 4 and not source.barrier.broken
        assert (store.loader.host is not None) == bool(host)
    finally:
        store.close()
        ops.close()


def test_a_load_that_finds_every_host_slot_busy_uses_a_staging_buffer():
    ops = AsyncFakeOps(2)
    copier = HostToDevice(ops, num_slots=4, unit_nbytes=UNIT_BYTES)
    host = HostTier(1, UNIT_BYTES, copier)
    source = PatternSource(2)
    loader = Loader(source, torch.device("cpu"), copier, host, verify=False)
    slots = torch.zeros(4, UNIT_BYTES, dtype=torch.uint8)
    loader._host_busy.add((0, 0))  # a load of (0, 0) is using the one host slot
    assert host.reserve((0, 0)) is not None
    assert loader.load((0, 1), 1, slots[1]) is Tier.DISK  # through a staging buffer: nothing evicted
    assert host.lookup((0, 1)) is None and host.evictions == 0
    loader._host_busy.clear()
    assert loader.load((0, 2), 2, slots[2]) is Tier.DISK and host.evictions == 1  # now (0, 0) is the victim
    assert loader.load((0, 2), 3, slots[3]) is Tier.HOST
    copier.before_use(1)
    copier.before_use(2)
    copier.before_use(3)
    ops.synchronize_compute()
    for slot, e in ((1, 1), (2, 2), (3, 2)):
        assert torch.equal(slots[slot], source.units[(0, e)])
    ops.close()


def test_a_cpu_fast_tier_under_a_busy_host_tier_reads_through_a_spare_buffer():
    source = PatternSource(3)
    host = HostTier(1, UNIT_BYTES, None)
    loader = Loader(source, torch.device("cpu"), None, host, verify=False)
    dst = torch.zeros(UNIT_BYTES, dtype=torch.uint8)
    loader._host_busy.add((0, 0))
    assert host.reserve((0, 0)) is not None
    assert loader.load((0, 5), 0, dst) is Tier.DISK and torch.equal(dst, source.units[(0, 5)])
    assert loader.load((0, 6), 0, dst) is Tier.DISK and torch.equal(dst, source.units[(0, 6)])  # the same spare


class FailingSource(PatternSource):
    def read_unit(self, layer: int, expert: int, unit_bytes: torch.Tensor) -> None:
        if expert == 3:
            raise OSError("input/output error")
        super().read_unit(layer, expert, unit_bytes)


@pytest.mark.parametrize("host", [0, 6])
def test_a_failed_read_gives_its_buffer_back_and_maps_nothing(host: int):
    ops = AsyncFakeOps(4)
    source = FailingSource(4)
    store = make_store(source, ops, capacity=4, host=host)
    try:
        with pytest.raises(ExpertLoadError, match="input/output error"):
            consume(store, ops, 0, [2, 3], source)
        loader = store.loader
        assert store.copier is not None and len(loader._free_buffers) == 2 and not loader._host_busy
        if loader.host is not None:
            assert loader.host.lookup((0, 3)) is None and loader.host.lookup((0, 2)) is not None
        consume(store, ops, 0, [2, 4], source)  # the store and the loader go on
        assert not store.cache.loading_keys and not store.cache.pinned_keys
    finally:
        store.close()
        ops.close()


# ------------------------------------------------------------------------- the store's tier plumbing and errors
def test_the_store_describes_its_host_tier_and_counts_its_bytes():
    ops = AsyncFakeOps(5)
    store = make_store(PatternSource(5), ops, capacity=4, host=6)
    try:
        host = store.loader.host
        assert host is not None and store.host_nbytes == host.nbytes >= 6 * UNIT_BYTES
        line = store.describe()
        assert "host tier 6 experts" in line and "pinned" in line and "2 pinned staging buffers" in line
        assert "\n" not in line
    finally:
        store.close()
        ops.close()


def test_a_resident_store_lends_no_moving_units_and_an_offloaded_one_refuses_to():
    ops = AsyncFakeOps(6)
    resident = make_store(PatternSource(6), ops, capacity=len(LAYERS) * NUM_EXPERTS)
    offloaded = make_store(PatternSource(6), ops, capacity=4)
    try:
        assert resident.resident and resident.staging_nbytes == resident.source.staging_nbytes
        assert len(resident.resident_units(0)) == NUM_EXPERTS
        with pytest.raises(MoeserveError, match="not resident"):
            offloaded.resident_units(0)
    finally:
        resident.close()
        offloaded.close()
        ops.close()


def test_an_unknown_prefetch_predictor_is_refused_in_one_line():
    with pytest.raises(MoeserveError, match=r"unknown prefetch_predictor 'oracle' \(affinity, hint\)"):
        ExpertStore(PatternSource(7), LAYERS, NUM_EXPERTS, 4, torch.device("cpu"),
                    options=StoreOptions(prefetch=True, prefetch_predictor="oracle"))


def test_close_stops_the_reference_scan():
    ops = AsyncFakeOps(8)
    store = make_store(PatternSource(8), ops, capacity=4)
    scan = store.start_reference_scan(lambda: True)
    assert scan is not None and store.start_reference_scan(lambda: True) is scan  # one scan per store
    store.close()
    ops.close()
    assert scan._stop.is_set() and not scan._thread.is_alive()
