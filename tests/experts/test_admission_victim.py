"""With expert_admission=policy, an admitted miss's victim is chosen once: `SlotCache.admits` keeps the victim it
weighed and `take_miss_slot` evicts it without asking the policy again, unless anything changed the cache in
between. Nothing else changes: replaying FLAME and the recorded demo traces through the store's cache calls gives
the same hits, misses, victims and bypasses as the cache that chose twice, and as `simulate(admission=True)`."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from moeserve.bench.simulate import simulate
from moeserve.experts.policies import DeferredHits, EvictionPolicy, make_policy
from moeserve.experts.policies.base import Key
from moeserve.experts.quota import make_quota
from moeserve.experts.slot_cache import SlotCache
from tests.experts.policy_traces import TRACES, replay_store_calls, trace_calls


class ChoosingTwice(SlotCache):
    """The cache as it was: `take_miss_slot` asks the policy for the victim again after `admits` chose it."""

    def take_miss_slot(self, key: Key) -> int | None:
        self._kept_victim = None
        return super().take_miss_slot(key)


def count_victim_choices(policy: EvictionPolicy) -> list[int]:
    """Counts `policy.choose_victim` calls in the returned one-element list."""
    count = [0]
    choose = policy.choose_victim

    def counted(pinned, layers=None):  # noqa: ANN001, ANN202
        count[0] += 1
        return choose(pinned, layers)

    policy.choose_victim = counted  # type: ignore[method-assign]
    return count


def replay(cls: type[SlotCache], trace: str, policy: str, capacity: int, mode: str):  # noqa: ANN201
    calls = trace_calls(trace)
    layers = sorted({c.layer for c in calls})
    inner = make_policy(policy)
    count = count_victim_choices(inner)

    def make_cache(on_map: Callable[[Key, int], None]) -> SlotCache:  # the store wraps its policy in DeferredHits
        return cls(capacity, DeferredHits(inner), layers, on_map, make_quota(mode, capacity, layers))

    cache, events = replay_store_calls(make_cache, calls, admission=True)
    return cache, events, count[0]


CASES = [("flame", "lfru", 128, "shared"), ("flame", "lfru", 128, "per_layer")] + [
    ("demo-batch1", "lfru", c, m) for c in TRACES["demo-batch1"] for m in ("shared", "per_layer")
] + [("demo-batch4", p, 12, "shared") for p in ("lfru", "reuse")]


@pytest.mark.parametrize(("trace", "policy", "capacity", "mode"), CASES)
def test_admitted_misses_choose_their_victim_once_and_cache_the_same(trace, policy, capacity, mode) -> None:
    cache, events, choices = replay(SlotCache, trace, policy, capacity, mode)
    _, before, choices_before = replay(ChoosingTwice, trace, policy, capacity, mode)
    assert events == before  # every hit, miss, victim and bypass, in order
    evicting = sum(1 for kind, _, victim in events if kind == "miss" and victim is not None)
    bypassed = sum(1 for kind, _, _ in events if kind == "bypass")
    assert evicting > 0 and bypassed > 0  # full-cache misses, some refused: the comparison means something
    assert choices == evicting + bypassed  # one choice per miss that weighs a victim
    assert choices_before == choices + evicting  # the old cache chose again for each admitted one
    sim = simulate([list(trace_calls(trace))], policy, capacity, cache_mode=mode, admission=True)
    assert (sim.hits, sim.misses, sim.bypassed) == (cache.stats.hits, cache.stats.misses, cache.stats.bypassed)
    assert sim.per_layer == {layer: (s.hits, s.misses) for layer, s in sorted(cache.stats.layers.items())}


def _full_cache() -> SlotCache:
    """LRU over one layer, 2 slots: (0, 0) then (0, 1) cached and released; (0, 0) is the LRU victim."""
    cache = SlotCache(2, make_policy("lru"), [0])
    for key in ((0, 0), (0, 1)):
        cache.pin([key])
        assert cache.begin_call(0, [key]) == [key]
        cache.take_miss_slot(key)
        cache.finish_read(key)
        cache.release([key])
    cache.pin([(0, 2)])
    assert cache.begin_call(0, [(0, 2)]) == [(0, 2)]
    return cache


@pytest.mark.parametrize("between", ["pin", "hit"])
def test_a_kept_victim_is_forgotten_when_the_cache_changes_in_between(between: str) -> None:
    cache = _full_cache()
    assert cache.admits((0, 2))  # weighed against (0, 0), the LRU key
    if between == "pin":  # (0, 0) pinned: it may no longer be evicted
        cache.pin([(0, 0)])
    else:  # a layer call used (0, 0): (0, 1) is now the LRU key
        cache.record_call(0, [(0, 0)])
    cache.take_miss_slot((0, 2))
    assert cache.slot((0, 0)) is not None  # the stale victim stayed
    assert cache.slot((0, 1)) is None


def test_the_kept_victim_is_evicted_when_nothing_changed() -> None:
    cache = _full_cache()
    policy = cache.policy
    assert policy is not None
    count = count_victim_choices(policy)
    assert cache.admits((0, 2))
    cache.take_miss_slot((0, 2))
    assert count[0] == 1 and cache.slot((0, 0)) is None and cache.slot((0, 1)) is not None
