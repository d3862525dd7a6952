"""The paged KV cache (state/kv_cache.py): layers grouped by kind, per-layer block views made once, and the pool
sizing that splits a KV byte budget between sliding-window and full-attention groups."""

from __future__ import annotations

import random

import pytest
import torch

from moeserve.state.kinds import FullAttention, SlidingWindow
from moeserve.state.kv_cache import (
    KVGroup,
    PagedKVCache,
    bytes_per_block,
    fixed_pool_bytes,
    kv_groups,
    size_pools,
)

CPU = torch.device("cpu")


# ------------------------------------------------------------------------------------------------ groups
def test_gpt_oss_like_alternating_layers_make_two_groups() -> None:
    groups = kv_groups([128, None] * 12)
    assert len(groups) == 2
    sliding, full = groups
    assert isinstance(sliding.kind, SlidingWindow) and sliding.kind.window == 128
    assert isinstance(full.kind, FullAttention)
    assert sliding.layers == tuple(range(0, 24, 2)) and full.layers == tuple(range(1, 24, 2))


def test_groups_come_in_order_of_their_first_layer_one_per_window() -> None:
    groups = kv_groups([None, None, 64, 128, 64, None])
    assert [g.kind.describe() for g in groups] == ["full attention", "sliding window 64", "sliding window 128"]
    assert [g.layers for g in groups] == [(0, 1, 5), (2, 4), (3,)]
    assert len(kv_groups([None] * 5)) == 1 and kv_groups([None] * 5)[0].layers == (0, 1, 2, 3, 4)
    assert kv_groups([]) == []


# ------------------------------------------------------------------------------------------------ tensors
def test_layer_views_have_the_paged_shape_and_are_made_once() -> None:
    groups = kv_groups([None, 8, None, 8, None])
    kv = PagedKVCache(groups, [5, 3], 4, 2, 8, torch.bfloat16, CPU)
    for layer in (0, 2, 4):
        k, v = kv.layer(layer)
        assert k.shape == v.shape == (5, 2, 4, 8) and k.dtype == torch.bfloat16 and kv.group_of(layer) == 0
    for layer in (1, 3):
        k, v = kv.layer(layer)
        assert k.shape == v.shape == (3, 2, 4, 8) and kv.group_of(layer) == 1
    assert kv.layer(2) is kv.layer(2), "the same view objects every call"
    assert kv.layer(2)[0].is_contiguous() and kv.layer(1)[1].is_contiguous()
    with pytest.raises(KeyError):
        kv.layer(5)


def test_a_write_through_one_layers_view_lands_only_there() -> None:
    groups = kv_groups([None, 8, None, 8])
    kv = PagedKVCache(groups, [5, 3], 4, 2, 8, torch.float32, CPU)
    k2, v2 = kv.layer(2)
    k2[3, 1, 2] = 1.5  # block 3, kv head 1, slot 2 of layer 2's keys
    assert float(k2.sum()) == 1.5 * 8 and float(kv.layer(2)[0][3, 1, 2, 0]) == 1.5
    assert float(v2.abs().sum()) == 0.0, "not the values"
    assert all(float(kv.layer(layer)[i].abs().sum()) == 0.0 for layer in (0, 1, 3) for i in (0, 1)), "nor another layer"
    v1 = kv.layer(1)[1]
    v1[0] = 2.0
    assert float(v1.sum()) == 2.0 * 2 * 4 * 8 and float(kv.layer(3)[1].abs().sum()) == 0.0
    assert float(kv.layer(2)[0].sum()) == 1.5 * 8, "the other group is untouched"


def test_nbytes_counts_every_group() -> None:
    groups = kv_groups([None, 8, None])
    kv = PagedKVCache(groups, [5, 3], 4, 2, 8, torch.bfloat16, CPU)
    assert kv.nbytes == 5 * bytes_per_block(2, 4, 2, 8, torch.bfloat16) + 3 * bytes_per_block(1, 4, 2, 8,
                                                                                             torch.bfloat16)
    assert bytes_per_block(2, 4, 2, 8, torch.bfloat16) == 2 * 2 * 4 * 2 * 8 * 2
    assert kv.nbytes == (5 * 2 + 3) * 2 * 4 * 2 * 8 * 2
    assert "5 blocks for 2 full attention layers" in kv.describe() and "3 blocks for 1 sliding window 8" in \
        kv.describe()


# ------------------------------------------------------------------------------------------------ sizing
def test_a_sliding_group_gets_a_bounded_pool_and_the_full_group_the_rest() -> None:
    groups = kv_groups([128, None] * 6)
    block = [bytes_per_block(6, 16, 8, 64, torch.bfloat16)] * 2
    kv_bytes = 3000 * block[0] + 123  # not a whole number of blocks
    sliding, full = size_pools(groups, block, kv_bytes, 16, 8, 2048, 131072)
    assert sliding == 8 * (SlidingWindow(128).max_live_blocks(1, 16) + 1) + 2048 // 16
    assert full == 3000 - sliding
    assert sliding * block[0] + full * block[1] <= kv_bytes
    assert (full + 1) * block[1] + sliding * block[0] > kv_bytes, "the full group takes all the rest"
    # More memory goes to the full group only.
    more = size_pools(groups, block, 2 * kv_bytes, 16, 8, 2048, 131072)
    assert more[0] == sliding and more[1] > 2 * full
    # Never more sliding blocks than the sequences could hold at max_model_len.
    short = size_pools(groups, block, kv_bytes, 16, 2, 2048, 64)
    assert short[0] == 2 * (64 // 16 + 1) and short[1] == 3000 - short[0]


def test_the_sliding_pool_holds_what_max_num_seqs_sequences_can_hold_at_once() -> None:
    for window, bs, seqs, batched in [(128, 16, 8, 2048), (100, 16, 3, 50), (4096, 32, 2, 512), (5, 16, 4, 4)]:
        (group,) = kv_groups([window])
        (n,) = size_pools([group], [1], 10**9, bs, seqs, batched, 10**6)
        kind = group.kind
        assert isinstance(kind, SlidingWindow)
        # All decode at once, or one takes the whole step's tokens while the rest decode.
        assert n >= seqs * kind.max_live_blocks(1, bs)
        assert n >= kind.max_live_blocks(batched, bs) + (seqs - 1) * kind.max_live_blocks(1, bs)
        rng = random.Random(window)
        for _ in range(200):  # any split of one step's tokens among the sequences (one that gets none holds too)
            cuts = sorted(rng.randrange(batched + 1) for _ in range(seqs - 1))
            split = [b - a for a, b in zip([0, *cuts], [*cuts, batched])]
            assert n >= sum(kind.max_live_blocks(max(t, 1), bs) for t in split), split


def test_full_groups_share_the_rest_one_block_id_space_each() -> None:
    groups = [KVGroup(FullAttention(), (0,)), KVGroup(FullAttention(), (1, 2, 3))]
    assert size_pools(groups, [100, 300], 4000, 16, 4, 64, 1024) == [10, 10]
    assert size_pools(groups, [100, 300], 3999, 16, 4, 64, 1024) == [9, 9]
    assert size_pools(groups, [100, 300], 0, 16, 4, 64, 1024) == [0, 0]


def test_fixed_pool_bytes_matches_size_pools() -> None:
    groups = kv_groups([128, None] * 6)
    block = [bytes_per_block(6, 16, 8, 64, torch.bfloat16)] * 2
    fixed, per_token = fixed_pool_bytes(groups, block, 16, 8, 2048, 131072)
    sliding = size_pools(groups, block, 0, 16, 8, 2048, 131072)[0]
    assert fixed == sliding * block[0] and per_token == block[1] // 16
    tokens = 40_000
    sizes = size_pools(groups, block, fixed + per_token * tokens, 16, 8, 2048, 131072)
    assert sizes == [sliding, tokens // 16], "the bytes fixed_pool_bytes asks for hold that many tokens"
    assert fixed_pool_bytes(kv_groups([None] * 4), [64], 16, 8, 2048, 4096) == (0, 4)
