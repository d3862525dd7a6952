"""The latent cache kind (multi-head latent attention): one row of `width` values per token and layer.

Its blocks are full attention's (tables, prefix hits, reuse); only what a block holds differs: bytes per block and
the tensor PagedKVCache allocates. The model side is tested in tests/models/test_deepseek_v3.py.
"""

from __future__ import annotations

import torch

from moeserve.state.kinds import FullAttention, LatentKV, kind_key
from moeserve.state.kv_cache import PagedKVCache, group_block_bytes, kv_groups, size_pools


def test_a_latent_block_holds_one_row_per_token_and_layer() -> None:
    kind = LatentKV(576)
    # 61 layers x 16 tokens x 576 values x 2 bytes (bf16): no factor 2 for K and V, no heads
    assert kind.block_bytes(61, 16, num_kv_heads=128, head_dim=64, itemsize=2) == 61 * 16 * 576 * 2
    assert FullAttention().block_bytes(61, 16, 128, 64, 2) == 2 * 61 * 16 * 128 * 64 * 2
    assert kind.blocks_for(33, 16) == 3 and kind.caches_prefixes and kind.fixed_blocks(8, 2048, 16) is None
    assert kind.usable_hit([1, 2, 3], 3, 16) and not kind.usable_hit([1, None, 3], 3, 16)
    assert kind_key(kind) != kind_key(FullAttention())


def test_latent_groups_and_pool() -> None:
    groups = kv_groups([None] * 3, latent=LatentKV(40))
    assert len(groups) == 1 and groups[0].layers == (0, 1, 2) and isinstance(groups[0].kind, LatentKV)
    block_bytes = group_block_bytes(groups, 16, num_kv_heads=4, head_dim=8, dtype=torch.bfloat16)
    assert block_bytes == [3 * 16 * 40 * 2]
    blocks = size_pools(groups, block_bytes, 10 * block_bytes[0], 16, 8, 64, 128)
    assert blocks == [10]
    kv = PagedKVCache(groups, blocks, 16, 4, 8, torch.bfloat16, torch.device("cpu"))
    assert kv.latent(1).shape == (10, 16, 40) and kv.group_of(2) == 0 and kv.nbytes == 10 * block_bytes[0]
    kv.latent(0)[3, 5] = 1.0  # layers are separate tensors
    assert not kv.latent(1).any()
