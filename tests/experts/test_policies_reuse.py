"""The reuse-distance policy ("reuse") and admission control (a bypass, simulator only), on hand-made sequences."""

from __future__ import annotations

import random

import pytest

from moeserve.bench.simulate import LayerCall, simulate
from moeserve.errors import ConfigError
from moeserve.experts.policies import AdaptiveLFRUPolicy, LFRUPolicy, ReusePolicy, make_policy
from moeserve.experts.slot_cache import SlotCache


def visit(policy: ReusePolicy, layer: int, *experts: int) -> None:
    policy.begin_layer(layer)
    for e in experts:
        policy.on_hit((layer, e))


def test_reuse_learns_distances_and_evicts_the_furthest():
    p = make_policy("reuse", rate=1.0)
    assert isinstance(p, ReusePolicy)
    p.begin_layer(0)
    for e in (1, 2):
        p.on_insert((0, e))
    # Expert 1 is used every visit, expert 2 every third visit.
    for v in range(2, 10):
        visit(p, 0, *((1, 2) if v % 3 == 1 else (1,)))
    visit(p, 0, 1)  # visit 10
    visit(p, 0, 1, 2)  # visit 11: 2 used after 4 visits (predicted next at 15); 1 predicted at 12
    assert p.choose_victim(set()) == (0, 2)
    assert p.choose_victim({(0, 2)}) == (0, 1)


def test_reuse_overdue_key_goes_first_and_prefetch_is_due_next_visit():
    p = ReusePolicy(rate=1.0, burst=False)
    p.begin_layer(0)
    p.on_insert((0, 1))
    p.on_insert((0, 2))
    visit(p, 0, 1, 2)  # both: distance 1
    for _ in range(6):
        visit(p, 0, 1)  # 2 unused: overdue by 5 visits, 1 due next visit
    assert p.choose_victim(set()) == (0, 2)
    p.on_evict((0, 2))
    p.on_insert((0, 3), prefetched=True)  # due at the next visit, like 1
    visit(p, 0, 1)  # 3 was not used at the visit it was prefetched for: overdue, goes before 1
    assert p.choose_victim(set()) == (0, 3)


def test_reuse_cycle_aware_across_layers():
    """Equal predicted distances: the key whose layer ran last waits a whole cycle, so it goes first."""
    p = ReusePolicy(rate=1.0)
    for _ in range(3):
        for layer in (0, 1, 2):
            p.begin_layer(layer)
            if _ == 0:
                p.on_insert((layer, 5))
            else:
                p.on_hit((layer, 5))
    assert p.choose_victim(set()) == (2, 5)
    assert p.choose_victim(set(), layers={0, 1}) == (1, 5)


def test_reuse_rejects_bad_rate():
    with pytest.raises(ConfigError, match="rate"):
        make_policy("reuse", rate=0)


@pytest.mark.parametrize("policy", ["lfru", "reuse"])
def test_admission_keeps_the_hot_expert(policy: str):
    """A cache of 2, experts 0 and 1 needed every step with a one-off: without admission each one-off evicts a hot
    expert (missed next step); with it the one-offs are served uncached and the hot pair always hits."""
    steps = [[LayerCall(0, (0, 1, 100 + i))] for i in range(40)]  # 0 and 1 hot, a one-off each step
    plain = simulate(steps, policy, 2)
    admitted = simulate(steps, policy, 2, admission=True)
    assert plain.accesses == admitted.accesses == 120
    assert admitted.hits > plain.hits
    assert admitted.hits >= 2 * 39 - 2  # the hot pair is kept from step 2 on (at most a warm-up miss or two)
    assert admitted.reads == admitted.misses  # a bypass is a read, counted as a miss


def test_bypass_counts_a_miss_and_maps_nothing():
    policy = LFRUPolicy(cycle_aware=True)
    cache = SlotCache(1, policy, layers=[0])
    cache.pin([(0, 0)])
    for key in cache.begin_call(0, [(0, 0)]):
        cache.take_miss_slot(key)
        cache.finish_read(key)
    cache.release([(0, 0)])
    for _ in range(3):  # expert 0 used often: a one-off expert 9 is not worth evicting it
        cache.pin([(0, 0)])
        assert cache.begin_call(0, [(0, 0)]) == []
        cache.release([(0, 0)])
    cache.pin([(0, 9)])
    assert cache.begin_call(0, [(0, 9)]) == [(0, 9)]
    assert not cache.admits((0, 9))
    cache.bypass((0, 9))
    cache.release([(0, 9)])
    assert cache.cached_keys() == {(0, 0)}
    assert (cache.stats.hits, cache.stats.misses) == (3, 2)


def test_admission_never_changes_what_is_counted():
    """Random traces over three layers: with and without admission, every needed expert is a hit or a miss."""
    rng = random.Random(3)
    steps = [[LayerCall(layer, tuple(sorted(rng.sample(range(8), 3)))) for layer in range(3)] for _ in range(60)]
    for policy in ("lfru", "reuse", "lru"):
        for capacity in (3, 6, 12):
            r = simulate(steps, policy, capacity, admission=True)
            assert r.accesses == 60 * 3 * 3
            assert r.reads == r.misses


def test_adaptive_lfru_admits_through_its_winner():
    p = AdaptiveLFRUPolicy()
    p.begin_layer(0)
    p.on_insert((0, 0))
    for _ in range(4):
        p.begin_layer(0)
        p.on_hit((0, 0))
    assert not p.admit((0, 7), (0, 0))
    p.on_bypass((0, 7))  # a use without a slot: nothing to evict later
    assert p.choose_victim(set()) == (0, 0)


@pytest.mark.parametrize("capacity", [1, 3, 6])
def test_reuse_in_the_store_counts_what_the_simulator_counts(capacity):
    """cache_policy=reuse in the engine's store (DeferredHits-wrapped, real slots): the simulator's hits and misses."""
    pytest.importorskip("torch")
    from tests.experts.test_store import make_store, use

    rng = random.Random(capacity)
    steps = [[LayerCall(layer, tuple(sorted(rng.sample(range(8), rng.randint(1, 4))))) for layer in (0, 1)]
             for _ in range(30)]
    expected = simulate(steps, "reuse", capacity)
    store = make_store(capacity, "reuse")
    for step in steps:
        for call in step:
            use(store, call.layer, list(call.expert_ids))
    assert (store.stats.hits, store.stats.misses) == (expected.hits, expected.misses)


@pytest.mark.parametrize("mode", ["per_layer", "mixed"])
def test_reuse_respects_the_capacity_modes(mode: str):
    """Its victims come from the layers the quota allows: no layer ever holds more than its ceiling."""
    from moeserve.experts.quota import make_quota
    from tests.experts.test_quota import call

    rng = random.Random(mode)
    layers = (2, 3, 5)
    quota = make_quota(mode, 9, layers)
    cache = SlotCache(9, make_policy("reuse"), layers, quota=quota)
    for _ in range(300):
        layer = rng.choice(layers)
        call(cache, layer, sorted(rng.sample(range(8), rng.randint(1, quota.chunk_limit(layer)))))
        for other in layers:
            assert cache.held(other) <= quota.ceilings.get(other, 9)
    assert cache.stats.hits > 0
