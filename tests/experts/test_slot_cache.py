"""SlotCache on hand-made access sequences (no torch): slots, pins, the exact calls the policy hears, counts, and
prefetch protection (a prefetch never evicts what it predicted)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from moeserve.errors import MoeserveError
from moeserve.experts.policies import EvictionPolicy, Key, LRUPolicy, make_policy
from moeserve.experts.slot_cache import SlotCache


class Recording(EvictionPolicy):
    """LRU that logs every call it gets, in order."""

    name = "recording"

    def __init__(self) -> None:
        self.inner = LRUPolicy()
        self.calls: list[tuple] = []

    def begin_layer(self, layer: int) -> None:
        self.calls.append(("begin", layer))

    def on_hit(self, key: Key) -> None:
        self.calls.append(("hit", key))
        self.inner.on_hit(key)

    def on_insert(self, key: Key, *, prefetched: bool = False) -> None:
        self.calls.append(("insert", key, prefetched))
        self.inner.on_insert(key, prefetched=prefetched)

    def on_evict(self, key: Key) -> None:
        self.calls.append(("evict", key))
        self.inner.on_evict(key)

    def choose_victim(self, pinned) -> Key:  # noqa: ANN001
        victim = self.inner.choose_victim(pinned)
        self.calls.append(("victim", victim))
        return victim


def call(cache: SlotCache, layer: int, ids, prefetch: list[Key] = ()) -> list[Key]:  # type: ignore[assignment]
    """One layer call as the store makes it (reads land at once); optionally prefetch after the demand loads."""
    keys = [(layer, e) for e in ids]
    cache.pin(keys)
    misses = cache.begin_call(layer, keys)
    for key in misses:
        assert cache.take_miss_slot(key) is not None
        cache.finish_read(key, 10)
    if prefetch:
        cache.protect(keys)
        for key in cache.plan_prefetch(prefetch):
            if cache.take_prefetch_slot(key) is None:
                break
            cache.finish_read(key, 10, prefetched=True)
    cache.release(keys)
    return misses


def test_slot_cache_imports_no_torch():
    code = "import sys, moeserve.experts.slot_cache; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_the_policy_hears_begin_then_hits_then_misses_in_order_with_insert_at_slot_time():
    policy = Recording()
    cache = SlotCache(3, policy)
    call(cache, 0, [1, 2])
    call(cache, 0, [0, 2, 3])  # 2 hits; 0 and 3 miss, in that order; 3 needs a victim: 1 (2 is pinned)
    assert policy.calls == [
        ("begin", 0), ("insert", (0, 1), False), ("insert", (0, 2), False),
        ("begin", 0), ("hit", (0, 2)), ("insert", (0, 0), False),
        ("victim", (0, 1)), ("evict", (0, 1)), ("insert", (0, 3), False),
    ]
    st = cache.stats.layer(0)
    assert (st.hits, st.misses, st.bytes_from_disk) == (1, 4, 40)
    assert cache.cached_keys() == {(0, 0), (0, 2), (0, 3)}


def test_slots_are_reused_and_the_map_callback_mirrors_the_map():
    seen: dict[Key, int] = {}
    cache = SlotCache(2, make_policy("lru"), layers=[0, 1],
                      on_map=lambda key, slot: seen.__setitem__(key, slot) if slot >= 0 else seen.pop(key))
    call(cache, 0, [4])
    call(cache, 1, [5])
    assert cache.slot((0, 4)) == 0 and cache.slot((1, 5)) == 1  # free slots go lowest first
    call(cache, 1, [6])  # evicts (0, 4): its slot 0 is reused
    assert cache.slot((1, 6)) == 0 and cache.slot((0, 4)) is None
    assert seen == cache.slot_map() == {(1, 5): 1, (1, 6): 0}
    assert set(cache.stats.layers) == {0, 1}


def test_pinned_keys_are_never_victims_and_a_call_larger_than_the_cache_is_refused():
    cache = SlotCache(2, make_policy("lru"))
    cache.pin([(0, 0), (0, 1)])
    assert cache.begin_call(0, [(0, 0), (0, 1)]) == [(0, 0), (0, 1)]
    for key in [(0, 0), (0, 1)]:
        cache.take_miss_slot(key)
        cache.finish_read(key)
    cache.pin([(0, 2)])  # three pinned keys in a cache of two: nothing can ever come free
    with pytest.raises(MoeserveError, match="no evictable slot"):
        cache.take_miss_slot((0, 2))


def test_a_miss_waits_while_the_only_slots_are_being_prefetched():
    cache = SlotCache(2, make_policy("lru"))
    call(cache, 0, [0])
    slot = cache.take_prefetch_slot((1, 5))  # the free slot, now loading
    assert slot == 1 and cache.loading_keys == {(1, 5)}
    cache.pin([(0, 0)])
    cache.begin_call(0, [(0, 0)])
    cache.pin([(0, 9)])
    assert cache.take_miss_slot((0, 9)) is None  # (0, 0) pinned, (1, 5) loading: ask again once it lands
    cache.finish_read((1, 5), prefetched=True)
    assert cache.take_miss_slot((0, 9)) == 1  # the prefetched unit was the victim


def test_all_cached_and_record_call_tell_the_policy_as_begin_call_does():
    a, b = Recording(), Recording()
    first, second = SlotCache(4, a), SlotCache(4, b)
    for cache in (first, second):
        call(cache, 0, [1, 2])
    assert first.all_cached(0, [(0, 1), (0, 3)]) is None  # one missing: nothing changed
    assert first.all_cached(0, [(0, 1), (0, 2)]) == [0, 1] and first.pinned_keys == {(0, 1), (0, 2)}
    first.release([(0, 1), (0, 2)])
    second.record_call(0, [(0, 1), (0, 2)])
    assert a.calls == b.calls and a.calls[-3:] == [("begin", 0), ("hit", (0, 1)), ("hit", (0, 2))]
    assert first.stats.layer(0).hits == second.stats.layer(0).hits == 2


def test_abandoned_reads_free_their_slot_and_undo_only_what_the_policy_heard():
    policy = Recording()
    cache = SlotCache(2, policy)
    cache.pin([(0, 1)])
    cache.begin_call(0, [(0, 1)])
    slot = cache.take_miss_slot((0, 1))
    cache.abandon_read((0, 1))  # a demand miss was inserted when it took its slot: evicted again
    assert policy.calls[-2:] == [("insert", (0, 1), False), ("evict", (0, 1))]
    cache.take_prefetch_slot((1, 3))
    cache.abandon_read((1, 3), prefetched=True)  # a prefetch is inserted only when it lands: nothing to undo
    assert policy.calls[-1] == ("evict", (0, 1))
    assert not cache.loading_keys and not cache.cached_keys() and not cache.protected_keys
    assert cache.take_miss_slot((0, 1)) == slot  # free again (the last freed is taken first)


def test_prefetch_never_evicts_a_cached_guess_nor_the_guessing_call():
    # LRU, 3 slots. The next layer call needs (1, 5) and (1, 6); (1, 5) is cached and the least recently used.
    # Unprotected, reading (1, 6) would evict (1, 5) just before it is needed.
    cache = SlotCache(3, make_policy("lru"))
    call(cache, 1, [5])
    call(cache, 0, [1])
    call(cache, 0, [0], prefetch=[(1, 5), (1, 6)])  # LRU order now: (1, 5), (0, 1), (0, 0)
    assert cache.cached_keys() == {(1, 5), (1, 6), (0, 0)}  # the victim was (0, 1)
    assert cache.protected_keys == {(0, 0), (1, 5), (1, 6)}
    assert call(cache, 1, [5, 6]) == []  # both hit
    st = cache.stats.layer(1)
    assert (st.hits, st.prefetched, st.prefetch_used) == (2, 1, 1)
    assert not cache.protected_keys  # the call they were protected for has begun


def test_prefetch_stops_when_every_slot_holds_a_pinned_protected_or_loading_key():
    cache = SlotCache(3, make_policy("lru"))
    call(cache, 1, [5])
    call(cache, 0, [0, 1], prefetch=[(1, 5), (1, 6), (1, 7)])  # (1, 5) protected, (0, 0) and (0, 1) too
    assert cache.cached_keys() == {(1, 5), (0, 0), (0, 1)} and cache.stats.prefetched == 0
    cache.end_protection()  # the request was dropped: its guesses are ordinary victims again
    assert cache.take_prefetch_slot((1, 6)) is not None and (1, 5) not in cache.cached_keys()


def test_prefetched_units_count_once_when_used_and_not_when_evicted_first():
    cache = SlotCache(2, make_policy("lru"))
    call(cache, 0, [0], prefetch=[(1, 1)])
    call(cache, 1, [1])
    call(cache, 1, [1])  # a second hit on it is not a second use of the prefetch
    call(cache, 0, [2], prefetch=[(1, 3)])  # (0, 2) evicts (0, 0); then (1, 3) evicts (1, 1)
    call(cache, 0, [4])  # evicts (0, 2)
    call(cache, 0, [5])  # evicts (1, 3), never used
    assert call(cache, 1, [3]) == [(1, 3)]  # read again on demand: a miss, not a use of the prefetch
    st = cache.stats
    assert (st.prefetched, st.prefetch_used, st.prefetch_accuracy) == (2, 1, 0.5)


def test_a_cache_without_policy_only_counts_resident_hits():
    cache = SlotCache(4, None, layers=[0, 1])
    assert [cache.place((layer, e)) for layer in (0, 1) for e in (0, 1)] == [0, 1, 2, 3]
    cache.count_resident_hits(1, 3)
    assert cache.stats.layers[1].hits == 3 and cache.stats.misses == 0
    with pytest.raises(MoeserveError, match="report the calls' keys"):
        SlotCache(2, make_policy("lru")).count_resident_hits(0, 1)
