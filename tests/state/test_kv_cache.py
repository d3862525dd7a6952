"""The slot KV cache (state/kv_cache.py): its size, per-layer views, slot accounting."""

from __future__ import annotations

import pytest
import torch

from moeserve.state.kv_cache import KVCache


def test_bytes_and_layer_views() -> None:
    kv = KVCache(num_layers=3, num_slots=4, max_len=16, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16,
                 device=torch.device("cpu"))
    assert kv.nbytes == KVCache.bytes_needed(3, 4, 16, 2, 8, torch.bfloat16) == 2 * 3 * 4 * 16 * 2 * 8 * 2
    k0, v0 = kv.layer(0)
    assert k0.shape == v0.shape == (4, 2, 16, 8) and k0.dtype == torch.bfloat16
    k0[1, :, 3] = 1.0  # a write through one layer's view lands there only
    k1, v1 = kv.layer(1)
    assert float(k0.sum()) == 16.0 and float(k1.sum()) == float(v0.sum()) == 0.0
    assert kv.layer(0)[0].data_ptr() == k0.data_ptr()  # views made once, not per call


def test_slots_are_allocated_once_each_and_come_back() -> None:
    kv = KVCache(1, 3, 8, 1, 4, torch.float32, torch.device("cpu"))
    got = [kv.allocate() for _ in range(3)]
    assert sorted(got) == [0, 1, 2] and kv.free_slots == 0
    with pytest.raises(RuntimeError, match="no free KV slot"):
        kv.allocate()
    kv.release(got[1])
    assert kv.free_slots == 1 and kv.allocate() == got[1]
