"""Capacity modes of the expert cache (experts/quota.py) in SlotCache, the policies, the simulator and the store:
shared, per_layer (a quota per layer) and mixed (a floor per layer, the rest shared). Pure Python except the last
test (the store, on a fake source)."""

from __future__ import annotations

import random

import pytest

from moeserve.bench.simulate import LayerCall, simulate
from moeserve.errors import ConfigError
from moeserve.experts.policies import ONLINE_POLICY_NAMES, make_policy
from moeserve.experts.quota import make_quota
from moeserve.experts.slot_cache import SlotCache

LAYERS = (2, 3, 5)


def test_per_layer_splits_evenly_and_gives_the_remainder_to_the_first_layers():
    q = make_quota("per_layer", 11, LAYERS)
    assert dict(q.floors) == dict(q.ceilings) == {2: 4, 3: 4, 5: 3}
    assert [q.chunk_limit(layer) for layer in LAYERS] == [4, 4, 3]
    assert "per_layer: 3-4 slots per MoE layer" in q.describe()


def test_mixed_keeps_half_of_each_equal_share_as_a_floor():
    q = make_quota("mixed", 12, LAYERS)
    assert dict(q.floors) == {2: 2, 3: 2, 5: 2}
    assert q.chunk_limit(2) == 12 - 4  # all but the other layers' floors
    assert "6 of 12 slots shared" in q.describe()


def test_shared_restricts_nothing():
    q = make_quota("shared", 4, LAYERS)
    assert q.victim_layers(2, {2: 4}) is None and q.chunk_limit(3) == 4 and q.may_grow(2, 3)


def test_bad_modes_are_one_line_errors():
    with pytest.raises(ConfigError, match="did you mean 'per_layer'"):
        make_quota("per-layer", 8, LAYERS)
    with pytest.raises(ConfigError, match="cannot give each of the 3 MoE layers one"):
        make_quota("per_layer", 2, LAYERS)


@pytest.mark.parametrize("name", ["lru", "lfu", "lfru", "belady"])
def test_every_policy_honours_a_layer_restriction(name):
    opts = {"future": [[(0, 0)], [(1, 0)], [(0, 1)], [(1, 1)]]} if name == "belady" else {}
    p = make_policy(name, **opts)
    for key in [(0, 0), (1, 0), (0, 1), (1, 1)]:
        p.begin_layer(key[0])
        p.on_insert(key)
    assert p.choose_victim(set(), (1,))[0] == 1
    assert p.choose_victim({(0, 0)}, (0,)) == (0, 1)


def lru_cache(capacity: int, mode: str) -> SlotCache:
    return SlotCache(capacity, make_policy("lru"), LAYERS, quota=make_quota(mode, capacity, LAYERS))


def call(cache: SlotCache, layer: int, ids) -> list:
    keys = [(layer, e) for e in ids]
    cache.pin(keys)
    misses = cache.begin_call(layer, keys)
    for key in misses:
        assert cache.take_miss_slot(key) is not None
        cache.finish_read(key)
    cache.release(keys)
    return misses


def test_per_layer_a_full_layer_evicts_its_own_expert_not_an_older_one_of_another_layer():
    cache = lru_cache(6, "per_layer")  # 2 slots per layer
    call(cache, 2, [0, 1])
    call(cache, 3, [0])
    call(cache, 3, [1])
    call(cache, 2, [5])  # layer 2 is full: its own LRU key (2, 0) goes, though the cache has a free slot
    assert cache.cached_keys() == {(2, 1), (2, 5), (3, 0), (3, 1)}
    call(cache, 5, [0, 1])  # layer 5 takes its own free slots
    assert cache.held(5) == 2 and len(cache.cached_keys()) == 6


def test_shared_mode_evicts_the_global_lru_instead():
    cache = lru_cache(4, "shared")
    call(cache, 2, [0, 1])
    call(cache, 3, [0, 1])
    call(cache, 3, [2])
    assert (2, 0) not in cache.cached_keys()


def test_mixed_a_layer_grows_into_the_shared_part_but_never_takes_another_layers_floor():
    cache = lru_cache(6, "mixed")  # floor 1 per layer, 3 shared
    call(cache, 2, [0])
    call(cache, 3, [0])
    call(cache, 5, [0, 1, 2, 3])  # grows to 4: the shared part is its
    assert cache.held(5) == 4
    call(cache, 5, [4])  # full cache: layers 2 and 3 sit at their floor, so layer 5 evicts its own LRU (5, 0)
    assert {(2, 0), (3, 0)} <= cache.cached_keys() and (5, 0) not in cache.cached_keys()
    call(cache, 2, [0])  # a hit: (2, 0) is now layer 2's newest
    call(cache, 2, [1])  # layer 2 may take from layer 5, above its floor: its LRU key (5, 1)
    assert cache.held(2) == 2 and cache.held(5) == 3


@pytest.mark.parametrize("mode", ["shared", "per_layer", "mixed"])
@pytest.mark.parametrize("policy", ONLINE_POLICY_NAMES[:3])
def test_random_walks_keep_the_quota_and_the_counts(mode, policy):
    rng = random.Random(f"{mode}-{policy}")
    capacity = 9
    quota = make_quota(mode, capacity, LAYERS)
    cache = SlotCache(capacity, make_policy(policy), LAYERS, quota=quota)
    for _ in range(300):
        layer = rng.choice(LAYERS)
        ids = sorted(rng.sample(range(8), rng.randint(1, min(8, quota.chunk_limit(layer)))))
        before = {layer_: cache.held(layer_) for layer_ in LAYERS}
        call(cache, layer, ids)
        counts = {layer_: sum(1 for k in cache.cached_keys() if k[0] == layer_) for layer_ in LAYERS}
        assert counts == {layer_: cache.held(layer_) for layer_ in LAYERS}
        for other in LAYERS:
            assert counts[other] <= quota.ceilings.get(other, capacity)
            if other != layer and counts[other] < before[other]:  # lost slots to `layer`: only above its floor
                assert counts[other] >= quota.floors.get(other, 0)


def test_the_simulator_chunks_a_call_at_the_layers_quota():
    steps = [[LayerCall(2, (0, 1, 2, 3, 4)), LayerCall(3, (0,)), LayerCall(5, (1,))] for _ in range(3)]
    r = simulate(steps, "lru", 6, cache_mode="per_layer")  # 2 slots per layer: layer 2 in chunks of 2
    assert r.cache_mode == "per_layer"
    assert r.per_layer[2] == (0, 15) and r.per_layer[3] == (2, 1)
    shared = simulate(steps, "lru", 6)
    assert shared.per_layer[3] == (0, 3)  # the global LRU order lets layer 2's calls flush layer 3


def test_the_store_follows_the_mode_and_logs_it():
    torch = pytest.importorskip("torch")
    from tests.experts.test_store import make_store, use

    store = make_store(capacity=4, policy="lru", layers=(0, 1), cache_mode="per_layer")
    assert "cache mode per_layer: 2 slots per MoE layer" in store.describe()
    assert store.cache.chunk_limit(0) == 2
    assert sum(use(store, 0, [0, 1, 2])) == 3  # in chunks of at most the layer's quota (lent as they land)
    use(store, 1, [3])
    use(store, 0, [4])  # layer 0 is full: it evicts its own, although a slot of layer 1 is free
    assert sum(1 for k in store.cached_keys() if k[0] == 0) == 2
    assert (1, 3) in store.cached_keys()
    assert torch is not None


@pytest.mark.parametrize("mode", ["per_layer", "mixed"])
def test_the_store_with_prefetch_keeps_the_quota_and_serves_the_right_units(mode):
    pytest.importorskip("torch")
    from tests.experts.test_store import make_store, use

    store = make_store(capacity=6, policy="lfru", layers=(0, 1, 2), num_experts=8, cache_mode=mode, prefetch=True,
                       prefetch_min_prob=0.0)
    rng = random.Random(mode)
    quota = store.cache.quota
    for _ in range(60):
        for layer in (0, 1, 2):
            use(store, layer, sorted(rng.sample(range(8), rng.randint(1, 3))))  # checks every unit's bytes
            store.prefetcher.wait_idle()
            for other in (0, 1, 2):
                assert store.cache.held(other) <= quota.ceilings.get(other, 6)
    assert store.stats.prefetched > 0
    store.close()
