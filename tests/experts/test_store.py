"""ExpertStore on hand-made access sequences, with a fake source whose units encode their (layer, expert).

Checks: hits/misses per layer, pins (an expert a chunk needs is never evicted under it), chunking when a layer
needs more experts than the cache holds, agreement with the cache simulator (which models the store), prefetch
bookkeeping, a failing read leaving the store consistent, and the statistics table.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from moeserve.bench.simulate import LayerCall, simulate
from moeserve.errors import ExpertLoadError
from moeserve.experts.store import ExpertStore, StoreOptions, format_stats
from moeserve.experts.unit import ExpertSource, UnitLayout

WIDTH = 8  # floats per fake unit


class FakeCheckpoint:
    def close(self) -> None:
        pass


class FakeSource(ExpertSource):
    """Unit (layer, expert) = WIDTH floats all equal to 100 * layer + expert. Can fail or be slow on demand."""

    def __init__(self, delay_s: float = 0.0, slow: dict[tuple[int, int], float] | None = None) -> None:
        super().__init__(FakeCheckpoint(), UnitLayout.build([("w", torch.float32, (WIDTH,))]), {})  # type: ignore[arg-type]
        self.reads: list[tuple[int, int]] = []
        self.fail: set[tuple[int, int]] = set()
        self.delay_s = delay_s
        self.slow = slow or {}  # per-unit read time, overriding delay_s
        self.in_flight = self.max_in_flight = 0
        self.landed_at: dict[tuple[int, int], float] = {}
        self._lock = threading.Lock()

    @property
    def stored_nbytes(self) -> int:
        return WIDTH * 4

    def unit_files(self, layer: int, expert: int) -> str:
        return "the fake source"

    def read_unit(self, layer: int, expert: int, unit_bytes: torch.Tensor) -> None:
        if (layer, expert) in self.fail:
            unit_bytes.fill_(0xFF)  # a half-done read leaves garbage behind
            raise OSError(f"fake read error in expert {expert}")
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        delay = self.slow.get((layer, expert), self.delay_s)
        if delay:
            time.sleep(delay)
        unit_bytes.view(torch.float32).fill_(100.0 * layer + expert)
        with self._lock:
            self.in_flight -= 1
            self.reads.append((layer, expert))
            self.landed_at[(layer, expert)] = time.monotonic()


def make_store(capacity: int, policy: str = "lru", layers=(0, 1), num_experts: int = 8, **options) -> ExpertStore:
    src = FakeSource(options.pop("delay_s", 0.0), options.pop("slow", None))
    opts = StoreOptions(policy=policy, **options)
    return ExpertStore(src, list(layers), num_experts, capacity, torch.device("cpu"), options=opts)  # type: ignore[arg-type]


def use(store: ExpertStore, layer: int, ids, prefetch=None) -> list[int]:
    """Run one layer call; checks every yielded unit holds the right expert; returns experts per chunk."""
    sizes = []
    for chunk in store.experts(layer, ids, prefetch=prefetch):
        sizes.append(len(chunk))
        for e, (w,) in chunk:
            assert torch.all(w == 100.0 * layer + e), f"slot of ({layer}, {e}) holds another unit"
    return sizes


def test_resident_store_loads_everything_once_and_only_hits():
    store = make_store(capacity=100)
    assert store.resident and len(store.source.reads) == 16
    use(store, 0, [1, 3, 5])
    use(store, 1, [0, 7])
    assert (store.stats.hits, store.stats.misses, store.stats.bytes_read) == (5, 0, 0)
    assert len(store.source.reads) == 16


def test_lru_sequence_hits_and_victims_by_hand():
    store = make_store(capacity=3, policy="lru")
    use(store, 0, [0, 1])  # misses 0, 1
    use(store, 0, [1, 2])  # hit 1, miss 2 -> cache {0, 1, 2}
    use(store, 0, [3])  # miss 3 evicts LRU = 0
    assert store.cached_keys() == {(0, 1), (0, 2), (0, 3)}
    use(store, 0, [0, 3])  # hit 3; miss 0 evicts LRU = 1 (2 was used after 1)
    assert store.cached_keys() == {(0, 2), (0, 3), (0, 0)}
    st = store.stats.layer(0)
    assert (st.hits, st.misses) == (2, 5)
    assert st.bytes_from_disk == 5 * WIDTH * 4 and st.bytes_from_host == 0
    assert sorted(store.source.reads) == [(0, 0), (0, 0), (0, 1), (0, 2), (0, 3)]  # 0 read again after eviction
    assert store.source.reads[-1] == (0, 0)


def test_layer_needing_more_than_the_cache_runs_in_ascending_chunks():
    store = make_store(capacity=2, io_threads=0)
    assert use(store, 1, [0, 2, 4, 5, 7]) == [2, 2, 1]
    assert store.stats.layer(1).misses == 5
    # Only the last chunk is left in the cache (plus one unit of the chunk before: capacity 2, last chunk 1).
    assert (1, 7) in store.cached_keys() and len(store.cached_keys()) == 2


def test_pinned_chunk_is_never_evicted_under_the_consumer():
    store = make_store(capacity=2, io_threads=0)
    gen = store.experts(0, [3, 4])
    chunk = next(gen)
    # Another access while the chunk is pinned must not take its slots (cache of 2: nothing is evictable).
    store.prefetch(1, [5])  # prefetch is off: a no-op
    assert {e for e, _ in chunk} == {3, 4}
    assert store.cache.pinned_keys == {(0, 3), (0, 4)}
    gen.close()
    assert store.cache.pinned_keys == set()


def test_a_call_of_cached_experts_takes_the_short_path_with_the_same_pins_and_counts():
    store = make_store(capacity=3, io_threads=0)
    use(store, 0, [3, 4])  # two misses: the general path
    calls = []
    general = store._acquire
    store._acquire = lambda *a: calls.append(a) or general(*a)  # type: ignore[method-assign]
    gen = store.experts(0, [3, 4])
    chunk = next(gen)
    assert [e for e, _ in chunk] == [3, 4] and store.cache.pinned_keys == {(0, 3), (0, 4)}
    assert all(torch.all(w == e) for e, (w,) in chunk)
    gen.close()
    assert store.cache.pinned_keys == set() and calls == []  # the short path: no _acquire
    st = store.stats.layer(0)
    assert (st.hits, st.misses) == (2, 2)
    use(store, 0, [4, 5])  # 5 is not cached: the general path again
    assert len(calls) == 1 and (st.hits, st.misses) == (3, 3)


@pytest.mark.parametrize("policy", ["lru", "lfu", "lfru"])
@pytest.mark.parametrize("capacity", [1, 3, 6])
def test_store_counts_match_the_cache_simulator(policy, capacity):
    rng = random.Random(capacity)
    steps = []
    for _ in range(30):
        steps.append([LayerCall(layer, tuple(sorted(rng.sample(range(8), rng.randint(1, 4))))) for layer in (0, 1)])
    expected = simulate(steps, policy, capacity)
    store = make_store(capacity, policy)
    for step in steps:
        for call in step:
            use(store, call.layer, list(call.expert_ids))
    assert (store.stats.hits, store.stats.misses) == (expected.hits, expected.misses)


@pytest.mark.parametrize("io_threads", [0, 2])
def test_failed_read_leaves_store_consistent_and_next_call_works(io_threads):
    store = make_store(capacity=2, io_threads=io_threads)
    use(store, 0, [0, 1])
    store.source.fail.add((0, 5))
    with pytest.raises(ExpertLoadError, match="expert 5 of layer 0") as err:
        use(store, 0, [5])
    assert "\n" not in str(err.value)
    assert store.cache.pinned_keys == set() and not store.cache.loading_keys
    assert (0, 5) not in store.cached_keys()
    assert store.stats.load_errors == 1
    # The slot that held garbage was freed, not mapped: every remaining unit is right, and the store still works.
    use(store, 0, [0, 1])
    store.source.fail.clear()
    use(store, 0, [5, 6])
    assert store.cached_keys() == {(0, 5), (0, 6)}


def test_misses_of_one_chunk_are_read_at_the_same_time():
    store = make_store(capacity=8, io_threads=2, delay_s=0.05)
    try:
        t0 = time.monotonic()
        assert sum(use(store, 0, [1, 3, 4, 6])) == 4
        elapsed = time.monotonic() - t0
        # 2 I/O threads + the compute thread: the 4 reads of 50 ms overlap (one after another would take 200 ms).
        assert store.source.max_in_flight >= 2
        assert elapsed < 0.18, elapsed
        assert store.stats.misses == 4 and store.cached_keys() == {(0, 1), (0, 3), (0, 4), (0, 6)}
        # The time counters: 4 reads of 50 ms on all threads together, of which the compute thread waited for less.
        assert store.stats.read_seconds >= 0.19 and 0.04 < store.stats.wait_seconds < store.stats.read_seconds
    finally:
        store.close()


def test_experts_already_in_are_yielded_while_a_later_miss_is_still_read():
    store = make_store(capacity=8, io_threads=2, slow={(0, 7): 0.3})
    try:
        use(store, 0, [1, 2])  # now cached
        gen = store.experts(0, [1, 2, 7])
        first = next(gen)
        got_first = time.monotonic()
        assert [e for e, _ in first] == [1, 2]  # the hits come first, in order, without waiting for 7
        assert (0, 7) not in store.source.landed_at  # expert 7 is still being read
        rest = [e for chunk in gen for e, _ in chunk]
        assert rest == [7] and store.source.landed_at[(0, 7)] > got_first
        assert store.cache.pinned_keys == set() and not store.cache.loading_keys
    finally:
        store.close()


def test_failed_read_among_several_misses_leaves_the_store_consistent():
    store = make_store(capacity=4, io_threads=2, delay_s=0.01)
    try:
        store.source.fail.add((0, 3))
        with pytest.raises(ExpertLoadError, match="expert 3 of layer 0"):
            use(store, 0, [1, 3, 5, 6])
        assert store.cache.pinned_keys == set() and not store.cache.loading_keys
        assert (0, 3) not in store.cached_keys() and store.stats.load_errors == 1
        # The slots of the other reads are either mapped (they landed) or free, never lost: the cache still works
        # at full capacity and every unit holds what it should.
        store.source.fail.clear()
        use(store, 0, [1, 3, 5, 6])
        use(store, 1, [0, 1, 2, 3])
        assert len(store.cached_keys()) == 4
    finally:
        store.close()


def test_affinity_prefetch_learns_what_follows_and_loads_it_before_the_layer_asks():
    # Two alternating patterns: layer 0 uses {0, 1} then layer 1 uses {2, 3}; or {4, 5} then {6, 7}. A cache of
    # 4 holds one pattern: without prefetch every layer-1 call misses twice. The store's own predictor learns the
    # pairs from the accesses and, once its guesses have proved right (calibrated chance >= 0.5), loads layer
    # 1's experts while layer 0 computes.
    store = make_store(capacity=4, layers=(0, 1), prefetch=True)
    assert store.predictor is not None and "affinity" in store.describe()
    try:
        late_misses = 0
        for step in range(12):
            a, b = ([0, 1], [2, 3]) if step % 2 == 0 else ([4, 5], [6, 7])
            use(store, 0, a, prefetch=(1, [5]))  # the caller's hint is ignored: the store predicts itself
            assert store.prefetcher is not None and store.prefetcher.wait_idle()
            before = store.stats.layer(1).misses
            use(store, 1, b)
            if step >= 8:
                late_misses += store.stats.layer(1).misses - before
        st = store.stats
        assert late_misses == 0
        assert st.prefetched > 0 and st.prefetch_accuracy is not None and st.prefetch_accuracy >= 0.75
        assert (1, 5) not in store.cached_keys()
        store.cancel_prefetch()  # nothing pending: a no-op that must not block
    finally:
        store.close()


class _HalfRightGuess:
    """A predictor guessing layer 1 needs [2, w]: 2 is right (and stays cached), w is a new wrong expert each time
    (4, 5, ..., 11 in turn), so it is never cached and never used."""

    def __init__(self) -> None:
        self.calls = 0

    def observe(self, layer, ids) -> None:  # noqa: ANN001
        pass

    def predict(self, layer, k, min_prob) -> list[int]:  # noqa: ANN001
        self.calls += 1
        return [2, 4 + self.calls % 8] if layer == 1 else []


def test_prefetch_stops_reading_guesses_that_were_not_used_when_not_cached():
    # By the predictor's count the guess is half right, but its uncached part is never used: after two or three
    # reads while the calibration has no evidence, the store reads no more guesses.
    store = make_store(capacity=4, layers=(0, 1), num_experts=12, prefetch=True)
    store.guesses.predictor = _HalfRightGuess()
    try:
        reads = []
        for _ in range(12):
            use(store, 0, [0])
            assert store.prefetcher is not None and store.prefetcher.wait_idle()
            reads.append(store.stats.prefetched)
            use(store, 1, [2, 3])
        assert reads[-1] == reads[3] <= 4, reads  # without the calibration: one more read every call
        assert store.guesses.reads_worth.chance(0) < 0.5
    finally:
        store.close()


def test_with_the_read_gate_shut_the_predictor_is_only_probed():
    """Once PROBE_AFTER uncached guesses proved not worth reading, the store asks its predictor on one layer call
    in PROBE_EVERY (still scoring those guesses, so the gate can open again), instead of at every call."""
    from moeserve.experts.prefetch.guess import PROBE_AFTER, PROBE_EVERY

    store = make_store(capacity=4, layers=(0, 1), num_experts=12, prefetch=True)
    guesser = _HalfRightGuess()
    store.guesses.predictor = guesser
    try:
        for _ in range(4 * PROBE_AFTER):  # a guess for layer 1 at every layer-0 call; its uncached part is unused
            use(store, 0, [0])
            assert store.prefetcher is not None and store.prefetcher.wait_idle()
            use(store, 1, [2, 3])
            if store.guesses.reads_worth.scored(0) >= PROBE_AFTER:
                break
        assert store.guesses.reads_worth.chance(0) < 0.5 and store.guesses.reads_worth.scored(0) >= PROBE_AFTER
        before = guesser.calls
        for _ in range(8 * PROBE_EVERY):  # 8 * PROBE_EVERY layer-0 calls (layer 1 has no next layer to guess)
            use(store, 0, [0])
            use(store, 1, [2, 3])
        assert guesser.calls - before == 8
    finally:
        store.close()


def test_prefetch_loads_in_the_background_and_counts_accuracy():
    store = make_store(capacity=4, prefetch=True, prefetch_predictor="hint")
    try:
        use(store, 0, [0, 1], prefetch=(1, [2, 3]))  # after layer 0's experts are in, guess layer 1 = {2, 3}
        deadline = time.monotonic() + 600  # a hang guard: the loop ends when the guesses land
        while {(1, 2), (1, 3)} - store.cached_keys() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert {(1, 2), (1, 3)} <= store.cached_keys()
        use(store, 1, [3, 4])  # 3 was guessed right (a hit), 4 is a miss; 2 was a wrong guess
        st = store.stats
        assert st.prefetched == 2 and st.prefetch_used == 1 and st.prefetch_accuracy == 0.5
        assert st.layer(1).hits == 1 and st.layer(1).misses == 1
        # Prefetched bytes count as read from disk for the layer they were prefetched for.
        assert st.layer(1).bytes_from_disk == 3 * WIDTH * 4
    finally:
        store.close()


@pytest.mark.parametrize("policy", ["lru", "lfu", "lfru"])
@pytest.mark.parametrize("capacity", [2, 5])
def test_store_with_prefetch_matches_the_simulator_when_each_prefetch_completes(policy, capacity):
    rng = random.Random(7 * capacity)
    steps = []
    for _ in range(25):
        calls = [tuple(sorted(rng.sample(range(8), rng.randint(1, 2)))) for _ in (0, 1, 2)]
        # Each call guesses the next layer's experts: some right, some wrong (the last layer guesses nothing).
        steps.append([LayerCall(layer, ids, tuple((layer + 1, e) for e in rng.sample(range(8), 3)) if layer < 2
                                else ()) for layer, ids in enumerate(calls)])
    expected = simulate(steps, policy, capacity, prefetch="predicted")
    store = make_store(capacity, policy, layers=(0, 1, 2), prefetch=True, prefetch_predictor="hint")
    try:
        for step in steps:
            for call in step:
                guess = (call.layer + 1, [e for _, e in call.predicted]) if call.predicted else None
                use(store, call.layer, list(call.expert_ids), prefetch=guess)
                assert store.prefetcher is not None and store.prefetcher.wait_idle()
        st = store.stats
        assert (st.hits, st.misses, st.prefetched, st.prefetch_used) == (
            expected.hits, expected.misses, expected.prefetched, expected.prefetch_used)
        assert st.prefetched > 0
    finally:
        store.close()


def test_prefetch_never_evicts_a_guess_that_is_already_cached():
    # LRU, 3 slots. Layer 1 will need 5 and 6; (1, 5) is cached and the least recently used unit. Reading the
    # guess 6 must take (0, 1)'s slot, not (1, 5)'s: the prefetcher protects the guesses it skips as cached.
    store = make_store(capacity=3, policy="lru", prefetch=True, prefetch_predictor="hint")
    try:
        use(store, 1, [5])
        use(store, 0, [1])
        use(store, 0, [0], prefetch=(1, [5, 6]))
        assert store.prefetcher is not None and store.prefetcher.wait_idle()
        assert store.cached_keys() == {(1, 5), (1, 6), (0, 0)}
        before = store.stats.misses
        use(store, 1, [5, 6])
        assert store.stats.misses == before and store.stats.prefetch_used == 1
    finally:
        store.close()


def test_prefetch_never_evicts_the_pinned_chunk():
    store = make_store(capacity=2, prefetch=True, prefetch_predictor="hint")
    try:
        gen = store.experts(0, [0, 1], prefetch=(1, [5, 6]))
        chunk = next(gen)  # the chunk fills the whole cache: the prefetch finds no evictable slot
        time.sleep(0.1)
        for e, (w,) in chunk:
            assert torch.all(w == e)
        assert store.cached_keys() == {(0, 0), (0, 1)}
        gen.close()
    finally:
        store.close()


def test_compute_thread_never_sees_a_half_written_unit_under_concurrent_prefetch():
    store = make_store(capacity=5, policy="lfru", layers=(0, 1, 2), prefetch=True, prefetch_predictor="hint", delay_s=0.002)
    rng = random.Random(0)
    try:
        for _ in range(40):
            for layer in (0, 1, 2):
                ids = sorted(rng.sample(range(8), 2))
                guess = (layer + 1, rng.sample(range(8), 3)) if layer < 2 else None
                use(store, layer, ids, prefetch=guess)  # asserts every unit's contents
        assert store.stats.prefetched > 0
        assert store.prefetcher is not None and store.prefetcher.wait_idle()  # the last guesses may be in flight
        assert not store.cache.loading_keys and not store.cache.pinned_keys
    finally:
        store.close()


def test_host_tier_serves_evicted_units_without_disk_reads():
    from moeserve.memory.device import DeviceOps

    class NoPinOps(DeviceOps):  # a CPU stand-in: pinning unavailable, synchronous copies
        def empty_pinned(self, nbytes):
            raise RuntimeError("no pinning here")

        def copy(self, dst, src, non_blocking):
            assert not non_blocking
            dst.copy_(src)

        def side_wait(self, event):
            pass

        def compute_wait(self, event):
            pass

        def compute_event(self):
            return None

        def synchronize(self, event):
            pass

    store = make_store(capacity=2, host_capacity=8, ops=NoPinOps())
    use(store, 0, [0, 1])
    use(store, 0, [2, 3])  # evicts 0, 1 from the fast tier; they stay in the host tier
    use(store, 0, [0, 1])
    st = store.stats.layer(0)
    assert st.misses == 6
    assert st.bytes_from_disk == 4 * WIDTH * 4
    assert st.bytes_from_host == 2 * store.unit_nbytes
    assert sorted(store.source.reads) == [(0, 0), (0, 1), (0, 2), (0, 3)]
    assert "host tier 8 experts" in store.describe() and "synchronous" in store.describe()


def test_format_stats_lists_layers_and_totals():
    store = make_store(capacity=2)
    use(store, 0, [0, 1])
    use(store, 1, [0])
    use(store, 0, [1])
    text = format_stats(store.stats)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["layer", "hits", "misses"]
    assert lines[1].split()[:3] == ["0", "1", "2"]
    assert lines[2].split()[:3] == ["1", "0", "1"]
    assert lines[3].split()[:3] == ["all", "1", "3"]
    assert "hit rate 25.0%" in text and "prefetch accuracy n/a" in text
