"""Eviction policies on hand-made access sequences; expected victims and hit counts worked out by hand."""

from __future__ import annotations

import random

import pytest

from moeserve.bench.simulate import LayerCall, simulate
from moeserve.errors import ConfigError
from moeserve.experts.policies import (
    POLICY_NAMES,
    AdaptiveLFRUPolicy,
    BeladyPolicy,
    LFRUPolicy,
    LFUPolicy,
    LRUPolicy,
    NoVictimError,
    StaticPolicy,
    make_policy,
)


def k(expert: int, layer: int = 0) -> tuple[int, int]:
    return (layer, expert)


def one_layer(*sets: tuple[int, ...], layer: int = 0) -> list[list[LayerCall]]:
    """One step per set: layer `layer` needs those experts."""
    return [[LayerCall(layer, tuple(sorted(s)))] for s in sets]


def test_lru_victim_is_least_recently_used():
    p = LRUPolicy()
    for e in (1, 2, 3):
        p.on_insert(k(e))
    p.on_hit(k(1))  # order now 2, 3, 1
    assert p.choose_victim(set()) == k(2)
    assert p.choose_victim({k(2)}) == k(3)  # pinned keys are skipped
    p.on_evict(k(2))
    assert p.choose_victim(set()) == k(3)
    with pytest.raises(NoVictimError):
        p.choose_victim({k(1), k(3)})


def test_lru_hit_count_by_hand():
    # capacity 2, accesses A B A C B A (one expert per step):
    # A miss, B miss, A hit, C miss evicts B (LRU), B miss evicts A, A miss evicts C -> 1 hit.
    r = simulate(one_layer((0,), (1,), (0,), (2,), (1,), (0,)), "lru", 2)
    assert (r.hits, r.misses) == (1, 5)


def test_lfu_prefers_frequent_and_ages():
    p = LFUPolicy()
    p.on_insert(k(1))
    p.on_hit(k(1))
    p.on_hit(k(1))  # k1: 3 uses, priority 3
    p.on_insert(k(2))  # priority 1
    assert p.choose_victim(set()) == k(2)
    p.on_evict(k(2))  # age becomes 1
    p.on_insert(k(3))  # priority 1 + 1 = 2
    assert p.choose_victim(set()) == k(3)
    p.on_evict(k(3))  # age 2
    p.on_insert(k(4))  # priority 2 + 1 = 3; ties with k1 (3), and k1 entered the heap first
    p.on_hit(k(4))  # priority 2 + 2 = 4 > 3: the old favourite k1 is now the victim
    assert p.choose_victim(set()) == k(1)


def test_lfu_hit_count_by_hand():
    # capacity 2, accesses A A B C A: A miss(1), A hit(2), B miss(1), C miss evicts B (1 < 2; age=1,
    # C priority 2), A hit -> 2 hits.
    r = simulate(one_layer((0,), (0,), (1,), (2,), (0,)), "lfu", 2)
    assert (r.hits, r.misses) == (2, 3)


def test_lfru_frequency_beats_recency_within_a_layer():
    p = LFRUPolicy(half_life=1.0)  # score halves per visit of the key's layer
    p.begin_layer(0)
    p.on_insert(k(1))
    p.on_insert(k(2))  # both score 1 at visit 1
    p.begin_layer(0)
    p.on_hit(k(1))  # visit 2: k1 = 1/2 + 1 = 1.5, k2 = 1/2
    p.begin_layer(0)
    p.on_insert(k(3))  # visit 3: k1 = 0.75, k2 = 0.25, k3 = 1
    assert p.choose_victim({k(3)}) == k(2)
    p.on_evict(k(2))
    assert p.choose_victim({k(3)}) == k(1)
    assert p.choose_victim(set()) == k(1)  # 0.75 < 1


def test_lfru_ages_per_layer_visit_not_global_time():
    # Layer 0 then layer 1 ran once, each using one expert. With a global clock the layer-0 key would look
    # older; here both have score 1 after one visit each, and the tie goes to the key whose layer ran most
    # recently (layer 1: its next chance of a hit is a whole forward away).
    p = LFRUPolicy(half_life=4.0)
    p.begin_layer(0)
    p.on_insert(k(5, layer=0))
    p.begin_layer(1)
    p.on_insert(k(7, layer=1))
    assert p.choose_victim(set()) == k(7, layer=1)
    # Next forward: layer 0 runs again without its key, so that key has aged one visit (score < 1).
    p.begin_layer(0)
    p.on_insert(k(6, layer=0))
    assert p.choose_victim({k(6, layer=0)}) == k(5, layer=0)


def test_lfru_remembers_evicted_frequency():
    p = LFRUPolicy(half_life=1000.0)
    p.begin_layer(0)
    for _ in range(3):
        p.on_insert(k(1)) if _ == 0 else p.on_hit(k(1))  # ~3 uses
    p.on_evict(k(1))
    p.on_insert(k(2))  # 1 use
    p.on_insert(k(1))  # reloaded: ~4 uses, so the newcomer k2 goes first
    assert p.choose_victim(set()) == k(2)


def test_static_keeps_profiled_keys_and_lru_for_the_rest():
    counts = {k(0): 10, k(1): 5, k(2): 1, k(3): 1}
    p = StaticPolicy(counts, num_pinned=1)
    assert p.static_keys == {k(0)}
    for e in (0, 1, 2):
        p.on_insert(k(e))
    assert p.choose_victim(set()) == k(1)  # k0 is static; k1 is the LRU of the rest
    assert p.choose_victim({k(1), k(2)}) == k(0)  # only the static key is left: it may go
    # capacity 2, static {A}: A B C B A -> A miss, B miss, C miss evicts B, B miss evicts C, A hit.
    r = simulate(
        one_layer((0,), (1,), (2,), (1,), (0,)),
        "static",
        2,
        policy_options={"counts": counts, "num_pinned": 1},
    )
    assert (r.hits, r.misses) == (1, 4)


def test_belady_by_hand():
    # capacity 2, A B C A B: A, B miss; C miss evicts whichever of A/B is needed later (B at 4 vs A at 3)
    # -> B; A hit; B miss -> 1 hit. LRU on the same sequence gets 0.
    seq = one_layer((0,), (1,), (2,), (0,), (1,))
    assert simulate(seq, "belady", 2).hits == 1
    assert simulate(seq, "lru", 2).hits == 0
    p = BeladyPolicy([[k(0)], [k(1)], [k(0)]])
    p.begin_layer(0)
    p.on_insert(k(0))
    p.begin_layer(0)
    p.on_insert(k(1))  # never used again
    assert p.choose_victim(set()) == k(1)


@pytest.mark.parametrize("policy", ["lru", "lfu", "lfru", "static", "belady"])
def test_pinned_keys_are_never_evicted(policy):
    # capacity 4; a layer needing 3 experts while 4 are cached: the 2 hits stay, 1 of the 2 others goes.
    steps = [[LayerCall(0, (0, 1, 2, 3))], [LayerCall(0, (0, 1, 9))]]
    options = {"counts": {k(0): 1}, "num_pinned": 1} if policy == "static" else {}
    r = simulate(steps, policy, 4, policy_options=options)
    assert (r.hits, r.misses) == (2, 5)
    p = make_policy(policy, **({"future": [[k(1)]]} if policy == "belady" else options))
    p.begin_layer(0)
    p.on_insert(k(0))
    p.on_insert(k(1))
    assert p.choose_victim({k(0)}) == k(1)
    assert p.choose_victim({k(1)}) == k(0)


def test_chunking_when_a_layer_needs_more_than_capacity():
    # capacity 2, layer needs {5, 1, 3} -> chunks [1, 3] then [5]; then the layer needs {1, 3, 5} again.
    # LRU: step 1: 1, 3 miss; 5 misses and evicts 1 (LRU, chunk [1, 3] released). Cache {3, 5}.
    # step 2: chunk [1, 3]: 3 hits, 1 misses and evicts 5 (3 is pinned); chunk [5]: misses, evicts 1.
    r = simulate([[LayerCall(0, (1, 3, 5))], [LayerCall(0, (1, 3, 5))]], "lru", 2)
    assert (r.hits, r.misses) == (1, 5)
    with pytest.raises(ConfigError):
        simulate([[LayerCall(0, (1,))]], "lru", 0)


def test_belady_bounds_online_policies_on_random_traces():
    for seed in range(4):
        rng = random.Random(seed)
        weights = [rng.random() ** 3 for _ in range(16)]
        steps = [
            [LayerCall(layer, tuple(sorted(set(rng.choices(range(16), weights, k=3))))) for layer in range(3)]
            for _ in range(150)
        ]
        counts = {(layer, e): w for layer in range(3) for e, w in enumerate(weights)}
        for capacity in (4, 9, 20):
            best = simulate(steps, "belady", capacity).hits
            for policy in ("lru", "lfu", "lfru"):
                assert simulate(steps, policy, capacity).hits <= best, (seed, capacity, policy)
            static = {"counts": counts, "num_pinned": capacity - 3}
            assert simulate(steps, "static", capacity, policy_options=static).hits <= best


def test_prefetch_oracle_and_accuracy():
    # capacity 4, layers 0 then 1 each need 2 experts, two identical steps. Oracle prefetch loads layer 1's
    # experts while layer 0 runs, and layer 0's (next step) while layer 1 runs: 4 prefetches, all used.
    steps = [[LayerCall(0, (0, 1)), LayerCall(1, (2, 3))]] * 2
    r = simulate(steps, "lru", 4, prefetch="oracle")
    assert (r.hits, r.misses, r.prefetched, r.prefetch_used) == (6, 2, 2, 2)
    assert r.prefetch_accuracy == 1.0
    # A wrong prediction is read and never used.
    steps = [[LayerCall(0, (0,), predicted=((1, 7),)), LayerCall(1, (2,))]]
    r = simulate(steps, "lru", 4, prefetch="predicted")
    assert (r.hits, r.misses, r.prefetched, r.prefetch_used, r.reads) == (0, 2, 1, 0, 3)


def test_make_policy_registry():
    assert set(POLICY_NAMES) == {"lru", "lfu", "lfru", "reuse", "static", "belady"}
    assert isinstance(make_policy("lfru"), AdaptiveLFRUPolicy)
    with pytest.raises(ConfigError, match="did you mean 'lfru'"):
        make_policy("lfruu")
    with pytest.raises(ConfigError):
        make_policy("belady")  # needs the future: simulator only
    with pytest.raises(ConfigError):
        make_policy("lru", capacity=3)


def test_prefetch_online_learns_as_it_replays():
    # Steps alternate A = (layer 0 {0}, layer 1 {1}) and B = (layer 0 {2}, layer 1 {3}); LRU, capacity 2.
    # Without prefetch every access misses. Online (width 1, no threshold), by hand:
    # A: 0, 1 miss (no table yet). B: 2 misses (evicts 0); layer 0 never used 2 before, so P(j | 2) is
    #   uniform and the guess is layer 1's expert 0 (ties by id): prefetched (evicts 1), wrong; 3 misses
    #   (evicts 2). A: 0 misses (evicts the wrong guess), guess 1 (row 0 -> 1) prefetched (evicts 3); 1 hits.
    # B: 2 misses (evicts 0), guess 3 prefetched (evicts 1); 3 hits.
    from moeserve.bench.simulate import OnlinePrefetch

    a = [LayerCall(0, (0,)), LayerCall(1, (1,))]
    b = [LayerCall(0, (2,)), LayerCall(1, (3,))]
    steps = [a, b, a, b]
    assert simulate(steps, "lru", 2).hits == 0
    r = simulate(steps, "lru", 2, prefetch="online", online=OnlinePrefetch(4, width=1))
    assert (r.hits, r.misses, r.prefetched, r.prefetch_used, r.steps) == (2, 6, 3, 2, 4)
    assert r.reads_per_step == 9 / 4
    # min_prob 0.5, two gates as in the store: the predictor's calibration (of all its guesses) and the read gate
    # (of its guesses that were not cached). The first guess (B) has the prior chance (0 + 1) / (0 + 2) = 0.5 at
    # both: prefetched, wrong. At the second A the predictor's rank 0 has (0 + 1) / (1 + 2) = 1/3: no guess, 0 and
    # 1 miss. At the second B its rank 0 is back at (1 + 1) / (2 + 2) = 0.5 (the unread guess 1 was right), but
    # the read gate has scored one uncached guess, unused: (0 + 1) / (1 + 2) < 0.5, so 3 is not read: it misses.
    r = simulate(steps, "lru", 2, prefetch="online", online=OnlinePrefetch(4, width=1, min_prob=0.5))
    assert (r.hits, r.misses, r.prefetched) == (0, 8, 1)
    with pytest.raises(ConfigError):
        simulate(steps, "lru", 2, prefetch="online")  # needs its settings


def _shifting_sets(rounds: int, per_round: int, set_size: int, seed: int) -> list[list[LayerCall]]:
    """One layer of 64 experts: each round a new random working set, reused `per_round` steps (a new prompt after
    a decode that kept reusing a few experts)."""
    rng = random.Random(seed)
    steps = []
    for _ in range(rounds):
        working = rng.sample(range(64), set_size)
        steps += one_layer(*[tuple(sorted(rng.sample(working, 2))) for _ in range(per_round)])
    return steps


def _popular_plus_scan(steps: int, seed: int) -> list[list[LayerCall]]:
    """One layer of 64 experts: 6 popular experts (one of them each step) plus a random one-off expert: frequency
    keeps the popular ones, recency lets the one-offs push them out."""
    rng = random.Random(seed)
    return one_layer(*[(rng.randrange(6), 6 + rng.randrange(58)) for _ in range(steps)])


def test_adaptive_lfru_follows_recency_when_the_working_set_moves():
    steps = _shifting_sets(rounds=12, per_round=40, set_size=6, seed=1)
    fixed = simulate(steps, "lfru", 8, policy_options={"adapt": False}).misses
    recency = simulate(steps, "lfru", 8, policy_options={"adapt": False, "max_score": 1}).misses
    adaptive = simulate(steps, "lfru", 8, policy_options={"window": 64}).misses
    assert recency < fixed  # the workload punishes stale counts
    assert adaptive <= recency + (fixed - recency) // 4, (fixed, recency, adaptive)


def test_adaptive_lfru_keeps_frequency_where_it_wins():
    steps = _popular_plus_scan(600, seed=2)
    fixed = simulate(steps, "lfru", 8, policy_options={"adapt": False}).misses
    recency = simulate(steps, "lfru", 8, policy_options={"adapt": False, "max_score": 1}).misses
    adaptive = simulate(steps, "lfru", 8, policy_options={"window": 64}).misses
    assert fixed < recency
    assert adaptive <= fixed + (recency - fixed) // 4, (fixed, recency, adaptive)


def _replay_both(a, b, calls, capacity: int, same_victim) -> None:  # noqa: ANN001 - two EvictionPolicy
    """Drive policies `a` and `b` through one cache as the store does (per call: begin_layer, hits, then misses
    evicting `a`'s victim); `same_victim()` says when `b` must have picked the same one."""
    cache: set[tuple[int, int]] = set()
    for layer, keys in calls:
        for p in (a, b):
            p.begin_layer(layer)
        for key in keys:
            if key in cache:
                a.on_hit(key)
                b.on_hit(key)
        for key in keys:
            if key not in cache:
                if len(cache) >= capacity:
                    victim = a.choose_victim(set(keys))
                    if same_victim():
                        assert victim == b.choose_victim(set(keys))
                    cache.remove(victim)
                    a.on_evict(victim)
                    b.on_evict(victim)
                cache.add(key)
                a.on_insert(key)
                b.on_insert(key)


def test_adaptive_lfru_without_adapting_is_lfru():
    """adapt=False: the same victims as LFRUPolicy, call for call (and frequency is the choice until recency has
    missed less, so a fresh adaptive policy starts as LFRU too)."""
    steps = _shifting_sets(rounds=4, per_round=20, set_size=6, seed=3) + _popular_plus_scan(100, seed=4)
    calls = [(0, [k(e) for e in step[0].expert_ids]) for step in steps]
    for options in ({"adapt": False}, {}):
        a = make_policy("lfru", **options)
        assert isinstance(a, AdaptiveLFRUPolicy)
        adapting = bool(not options)
        _replay_both(a, LFRUPolicy(), calls, 8, lambda a=a, adapting=adapting: not adapting or a.winner == 0)


def test_layer_recency_orders_like_lfru_capped_at_one_use():
    """The adaptive policy's cheap recency side picks LFRUPolicy(max_score=1)'s victims (demand accesses)."""
    from moeserve.experts.policies import _LayerRecency

    rng = random.Random(5)
    calls = [(layer, [k(e, layer) for e in sorted(rng.sample(range(12), 2))]) for _ in range(400) for layer in range(3)]
    _replay_both(_LayerRecency(), LFRUPolicy(max_score=1), calls, 10, lambda: True)


@pytest.mark.parametrize("name", ["lru", "lfu", "lfru"])
@pytest.mark.parametrize("max_pending", [1, 3, 512])
def test_deferred_hits_make_the_same_choices(name, max_pending):
    """DeferredHits (the store's wrapper: visits and hits replayed in batches) picks the wrapped policy's victims,
    call for call, whether the log is replayed at every call, every 3 events, or only before a miss."""
    from moeserve.experts.policies import DeferredHits

    rng = random.Random(7)
    calls = [(layer, [k(e, layer) for e in sorted(rng.sample(range(12), 3))]) for _ in range(300) for layer in range(3)]
    deferred = DeferredHits(make_policy(name), max_pending=max_pending)
    assert deferred.name == name
    _replay_both(make_policy(name), deferred, calls, 14, lambda: True)


def test_deferred_hits_wait_until_a_choice_needs_them():
    from moeserve.experts.policies import DeferredHits, LRUPolicy

    seen: list[object] = []

    class Recording(LRUPolicy):
        def begin_layer(self, layer: int) -> None:
            seen.append(("visit", layer))

        def on_hit(self, key: tuple[int, int]) -> None:
            seen.append(("hit", key))
            super().on_hit(key)

    deferred = DeferredHits(Recording(), max_pending=4)
    for e in (1, 2):
        deferred.on_insert(k(e))
    deferred.begin_layer(0)
    deferred.on_hit(k(2))
    assert seen == []  # logged only
    assert deferred.choose_victim(set()) == k(1)  # replayed first: 2 was used after 1
    assert seen == [("visit", 0), ("hit", k(2))]
    for _ in range(2):
        deferred.begin_layer(0)
        deferred.on_hit(k(1))
    assert len(seen) == 6  # the 4th logged event replays the log: its length stays bounded


def test_cycle_aware_lfru_weighs_the_distance_to_the_layers_next_visit():
    """Layers 0, 1, 2 run in a cycle; (0, 1) is used on 3 visits of 4, (2, 1) on every one. Just after layer 2 ran,
    plain LFRU evicts the less used (0, 1), needed at the very next call about 3 times in 4; cycle-aware LFRU
    evicts (2, 1), whose next use is at least 3 calls away: 3.75 expected calls against 2.8."""
    from moeserve.experts.policies import LFRUPolicy

    choices = {}
    for cycle in (False, True):
        p = LFRUPolicy(cycle_aware=cycle)
        for t in range(64):
            for layer in (0, 1, 2):
                p.begin_layer(layer)
                key = (layer, 1)
                if layer == 1 or (layer == 0 and t % 4 == 3):
                    continue
                (p.on_hit if t else p.on_insert)(key)
        choices[cycle] = p.choose_victim(set())
    assert choices == {False: (0, 1), True: (2, 1)}
