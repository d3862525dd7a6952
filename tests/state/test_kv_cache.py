"""The paged KV cache (state/kv_cache.py): groups by kind, per-layer block views, pool sizing."""

from __future__ import annotations

import torch

from moeserve.state.kinds import FullAttention, SlidingWindow
from moeserve.state.kv_cache import PagedKVCache, bytes_per_block, kv_groups, size_pools


def test_layers_group_by_kind_in_order_of_their_first_layer() -> None:
    groups = kv_groups([128, None, 128, None, 64])
    assert [type(g.kind) for g in groups] == [SlidingWindow, FullAttention, SlidingWindow]
    assert [g.layers for g in groups] == [(0, 2), (1, 3), (4,)]


def test_block_views_are_made_once_and_writes_stay_in_their_layer() -> None:
    groups = kv_groups([None, 8, None])
    kv = PagedKVCache(groups, [5, 3], 4, 2, 8, torch.bfloat16, torch.device("cpu"))
    k0, v0 = kv.layer(0)
    assert k0.shape == v0.shape == (5, 2, 4, 8) and kv.layer(1)[0].shape == (3, 2, 4, 8)
    assert kv.group_of(0) == kv.group_of(2) == 0 and kv.group_of(1) == 1
    k0[2, :, 1] = 1.0
    assert float(k0.sum()) == 16.0 and float(kv.layer(2)[0].sum()) == float(v0.sum()) == 0.0
    assert kv.layer(0)[0].data_ptr() == k0.data_ptr()
    assert kv.nbytes == (5 * 2 + 3) * bytes_per_block(1, 4, 2, 8, torch.bfloat16)


def test_a_sliding_group_gets_a_bounded_pool_and_the_full_group_the_rest() -> None:
    groups = kv_groups([128, None] * 6)
    block = [bytes_per_block(6, 16, 8, 64, torch.bfloat16)] * 2
    kv_bytes = 3000 * block[0]
    sizes = size_pools(groups, block, kv_bytes, 16, 8, 2048, 131072)
    sliding, full = sizes
    assert sliding == 8 * (SlidingWindow(128).max_live_blocks(1, 16) + 1) + 2048 // 16
    assert full == 3000 - sliding and sum(n * b for n, b in zip(sizes, block)) <= kv_bytes
    short = size_pools(groups, block, kv_bytes, 16, 2, 2048, 64)  # never more than the sequences could hold
    assert short[0] == 2 * (64 // 16 + 1)
