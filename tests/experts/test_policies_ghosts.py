"""The cuts in LFRU's bookkeeping: adaptive LFRU's ghost caches on a hashed sample of the keys, and the per-layer
victim candidates cached between calls; each keeps the decisions."""

from __future__ import annotations

import random

import pytest

from moeserve.bench.simulate import LayerCall, simulate
from moeserve.experts.policies import AdaptiveLFRUPolicy, LFRUPolicy, NoVictimError


def shifting_sets(rounds: int, per_round: int, seed: int, experts: int = 256) -> list[list[LayerCall]]:
    """Two layers: each round a new random working set of 12 experts per layer, reused `per_round` steps."""
    rng = random.Random(seed)
    steps = []
    for _ in range(rounds):
        working = [rng.sample(range(experts), 12) for _ in range(2)]
        steps += [[LayerCall(layer, tuple(sorted(rng.sample(working[layer], 3)))) for layer in range(2)]
                  for _ in range(per_round)]
    return steps


def popular_plus_scan(steps: int, seed: int, experts: int = 256) -> list[list[LayerCall]]:
    """Two layers: 12 popular experts per layer (two each step) plus a one-off expert."""
    rng = random.Random(seed)
    return [[LayerCall(layer, tuple(sorted({*rng.sample(range(12), 2), 12 + rng.randrange(experts - 12)})))
             for layer in range(2)] for _ in range(steps)]


def misses(steps: list[list[LayerCall]], **options: object) -> int:
    return simulate(steps, "lfru", 24, policy_options=options).misses


def test_sampled_ghosts_follow_recency_when_the_working_set_moves():
    steps = shifting_sets(rounds=12, per_round=40, seed=1)
    fixed, recency = misses(steps, adapt=False), misses(steps, adapt=False, max_score=1)
    sampled = misses(steps, window=128, ghost_keys=8)  # a third of the keys in ghosts of 8
    assert recency < fixed
    assert sampled <= recency + (fixed - recency) // 3, (fixed, recency, sampled)


def test_sampled_ghosts_keep_frequency_where_it_wins():
    steps = popular_plus_scan(600, seed=2)
    fixed, recency = misses(steps, adapt=False), misses(steps, adapt=False, max_score=1)
    sampled = misses(steps, window=128, ghost_keys=8)
    assert fixed < recency
    assert sampled <= fixed + (recency - fixed) // 3, (fixed, recency, sampled)


def test_sampling_starts_at_the_first_eviction_and_scales_the_ghosts():
    p = AdaptiveLFRUPolicy(ghost_keys=4)
    p.begin_layer(0)
    for e in range(16):
        p.on_insert((0, e))
    assert p.choose_victim(set()) in {(0, e) for e in range(16)}
    assert p._ghost_capacity == 4  # 16 slots at a sampling rate of 1/4
    for g in p._ghosts:
        assert all(p._in_sample(key) for key in g.keys)
    share = sum(p._in_sample((layer, e)) for layer in range(8) for e in range(64)) / 512
    assert 0.18 < share < 0.32  # about the rate, 1/4


@pytest.mark.parametrize("cycle_aware", [True, False])
def test_lfru_cached_candidates_give_the_scan_victim(cycle_aware: bool):
    """choose_victim's per-layer candidate cache: the victim always has the rank a scan of every cached, unpinned key
    finds best (random calls over four layers, misses evicting, some keys prefetched, per-layer restrictions)."""
    rng = random.Random(11)
    p = LFRUPolicy(cycle_aware=cycle_aware)
    cached: set[tuple[int, int]] = set()

    def rank(key: tuple[int, int]) -> tuple[float, float]:
        log_now = p._log_score_now(key)
        if cycle_aware:
            return (-p._time_to_use(key[0], log_now), 0.0)
        return (round(log_now, 9), -p._last_tick.get(key[0], 0))

    for _ in range(300):
        for layer in range(4):
            keys = [(layer, e) for e in sorted(rng.sample(range(10), 3))]
            p.begin_layer(layer)
            for key in keys:
                if key in cached:
                    p.on_hit(key)
            for key in keys:
                if key in cached:
                    continue
                if len(cached) >= 14:
                    allowed = None if rng.random() < 0.7 else {layer, rng.randrange(4)}
                    options = [k for k in cached if k not in keys and (allowed is None or k[0] in allowed)]
                    if not options:
                        with pytest.raises(NoVictimError):
                            p.choose_victim(set(keys), allowed)
                        allowed = None
                        options = [k for k in cached if k not in keys]
                    victim = p.choose_victim(set(keys), allowed)
                    assert victim in options
                    assert rank(victim) == min(rank(k) for k in options)
                    cached.remove(victim)
                    p.on_evict(victim)
                cached.add(key)
                p.on_insert(key, prefetched=rng.random() < 0.1)
