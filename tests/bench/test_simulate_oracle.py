"""Perfect prefetch is an upper bound: with the next layer call's exact experts ("oracle") and prefetch that never
evicts what it predicted, the hit rate is at least demand-only Belady's, and once the cache holds two layer calls
every call but the first hits."""

from __future__ import annotations

import random

import pytest

from moeserve.bench.flame import load_flame
from moeserve.bench.simulate import LayerCall, calls_from_steps, simulate
from tests.bench.test_simulate_flame import FLAME, needs_flame


@needs_flame
def test_oracle_prefetch_beats_belady_at_every_capacity_of_the_flame_trace():
    header, steps = load_flame(FLAME)
    calls = calls_from_steps(steps)
    per_call = header.top_k  # batch 1: every layer call needs top_k experts
    assert {len(c.expert_ids) for step in calls for c in step} == {per_call}
    for capacity in [*range(1, 2 * per_call + 1), 16, 32, 64, 128, 256, 512]:
        bound = simulate(calls, "belady", capacity)
        oracle = simulate(calls, "lru", capacity, prefetch="oracle")
        assert oracle.accesses == bound.accesses
        assert oracle.hit_rate >= bound.hit_rate, capacity
        if capacity >= 2 * per_call:  # room for this call and the next: only the very first call misses
            assert oracle.misses == per_call, capacity
        elif capacity > per_call:  # the spare slots are prefetched into, and every prefetch is used
            assert oracle.prefetch_used == oracle.prefetched > 0, capacity


def _two_per_layer(layers: int = 32, steps: int = 200, seed: int = 0) -> list[list[LayerCall]]:
    """Mixtral-like decode routing: top-2 of 8 experts per layer, each layer with its own skewed popularity."""
    rng = random.Random(seed)
    weights = [[rng.random() ** 4 for _ in range(8)] for _ in range(layers)]
    out = []
    for _ in range(steps):
        step = []
        for layer in range(layers):
            ids: set[int] = set()
            while len(ids) < 2:
                ids.add(rng.choices(range(8), weights[layer])[0])
            step.append(LayerCall(layer, tuple(sorted(ids))))
        out.append(step)
    return out


@pytest.mark.parametrize("policy", ["lru", "lfu", "lfru"])
def test_oracle_prefetch_hits_every_call_but_the_first_with_two_experts_per_layer(policy):
    # Here a cached expert of the next call used to be skipped by prefetch without protection, and loading the
    # other one evicted it (LRU picks exactly that one at 64 slots: hit rate 0.93, with more reads).
    steps = _two_per_layer()
    for capacity in (4, 5, 8, 16, 32, 64, 96, 128, 192):
        oracle = simulate(steps, policy, capacity, prefetch="oracle")
        assert oracle.misses == 2, (policy, capacity)
        assert oracle.hit_rate >= simulate(steps, "belady", capacity).hit_rate
        assert oracle.prefetch_used == oracle.prefetched  # nothing prefetched is evicted before its use
