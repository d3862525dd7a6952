"""Slot-based KV cache: one preallocated [slots, kv_heads, max_len, head_dim] tensor per layer for K and V.

A sequence owns one slot from admission to finish; its tokens occupy positions [0, length) of the slot. The
whole cache is allocated once at start-up (its size is printed), so a long run never grows memory.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_slots, self.max_len = num_slots, max_len
        shape = (num_layers, 2, num_slots, num_kv_heads, max_len, head_dim)
        self._kv = torch.zeros(shape, dtype=dtype, device=device)
        # (K, V) views per layer, made once: slicing costs ~10 us of Python per call, twice per layer per step
        self._layers = [(self._kv[i, 0], self._kv[i, 1]) for i in range(num_layers)]
        self._free = list(range(num_slots - 1, -1, -1))

    @staticmethod
    def bytes_needed(num_layers: int, num_slots: int, max_len: int, num_kv_heads: int, head_dim: int,
                     dtype: torch.dtype) -> int:
        return 2 * num_layers * num_slots * max_len * num_kv_heads * head_dim * dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self._kv.numel() * self._kv.element_size()

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of `layer`, each [slots, kv_heads, max_len, head_dim]."""
        return self._layers[layer]

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("no free KV slot")  # the scheduler admits only when a slot is free
        return self._free.pop()

    def release(self, slot: int) -> None:
        self._free.append(slot)
