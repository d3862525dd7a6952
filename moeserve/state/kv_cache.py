"""The paged KV cache: per KV group, one [layers, 2, blocks, kv_heads, block_size, head_dim] tensor.

Layers with the same kind of memory (state/kinds.py: full attention, one sliding window size) form a group; a
group's layers share its block ids (block b of a sequence holds the same tokens in each of them), so a sequence has
one block table per group (state/manager.py decides them). Token at position p of a sequence is at row
`table[p // block_size] * block_size + p % block_size` of its group's layers (its "slot": the C++ ops take these
slots for the writes and the block tables for the reads). The tensors are allocated once at start-up from the
memory split (memory/split.py), so a long run never grows memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moeserve.state.kinds import CacheKind, FullAttention, SlidingWindow, kind_key


@dataclass(frozen=True)
class KVGroup:
    kind: CacheKind
    layers: tuple[int, ...]


def kv_groups(windows: Sequence[int | None]) -> list[KVGroup]:
    """Group the attention layers by kind: `windows[i]` is layer i's sliding window (None: full attention)."""
    kinds: dict[tuple[str, int], CacheKind] = {}
    members: dict[tuple[str, int], list[int]] = {}
    for layer, window in enumerate(windows):
        kind: CacheKind = FullAttention() if window is None else SlidingWindow(window)
        key = kind_key(kind)
        kinds.setdefault(key, kind)
        members.setdefault(key, []).append(layer)
    return [KVGroup(kinds[key], tuple(members[key])) for key in sorted(members, key=lambda k: members[k][0])]


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


class PagedKVCache:
    def __init__(self, groups: Sequence[KVGroup], num_blocks: Sequence[int], block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.groups, self.num_blocks, self.block_size = list(groups), list(num_blocks), block_size
        self._group_of: dict[int, int] = {}
        self._layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._tensors: list[torch.Tensor] = []
        for g, (group, n) in enumerate(zip(self.groups, self.num_blocks)):
            kv = torch.zeros((len(group.layers), 2, n, num_kv_heads, block_size, head_dim), dtype=dtype,
                             device=device)
            self._tensors.append(kv)
            for i, layer in enumerate(group.layers):
                self._group_of[layer] = g
                self._layers[layer] = (kv[i, 0], kv[i, 1])  # views made once: slicing costs ~10 us per call

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of `layer`, each [blocks, kv_heads, block_size, head_dim]."""
        return self._layers[layer]

    def group_of(self, layer: int) -> int:
        return self._group_of[layer]

    def describe(self) -> str:
        parts = [f"{n} blocks for {len(g.layers)} {g.kind.describe()} layers" for g, n in
                 zip(self.groups, self.num_blocks)]
        return f"{', '.join(parts)}; {self.block_size} tokens per block, {self.nbytes / 2**20:.1f} MiB"


def size_pools(groups: Sequence[KVGroup], block_bytes: Sequence[int], kv_bytes: int, block_size: int,
               max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int) -> list[int]:
    """Blocks per group for a pool of `kv_bytes`. A sliding-window group gets what its sequences can hold at once
    (each its window plus one step's tokens: SlidingWindow.max_live_blocks), never more than a full group would;
    the full-attention groups share the rest in proportion to their block sizes (one block id space each)."""
    per_seq = -(-max_model_len // block_size) + 1
    sizes: list[int | None] = []
    fixed = 0
    for group, nbytes in zip(groups, block_bytes):
        if isinstance(group.kind, SlidingWindow):
            live = (max_num_seqs * (group.kind.max_live_blocks(1, block_size) + 1)
                    + -(-max_num_batched_tokens // block_size))
            n = min(live, max_num_seqs * per_seq)
            sizes.append(n)
            fixed += n * nbytes
        else:
            sizes.append(None)
    full_bytes = sum(b for s, b in zip(sizes, block_bytes) if s is None)
    n_full = max(0, kv_bytes - fixed) // full_bytes if full_bytes else 0
    return [n_full if s is None else s for s in sizes]


def fixed_pool_bytes(groups: Sequence[KVGroup], block_bytes: Sequence[int], block_size: int, max_num_seqs: int,
                     max_num_batched_tokens: int, max_model_len: int) -> tuple[int, int]:
    """(bytes of the sliding-window groups, bytes per token of the full-attention groups) of `size_pools`."""
    sizes = size_pools(groups, block_bytes, 0, block_size, max_num_seqs, max_num_batched_tokens, max_model_len)
    fixed = sum(n * b for g, n, b in zip(groups, sizes, block_bytes) if isinstance(g.kind, SlidingWindow))
    per_token = sum(b for g, b in zip(groups, block_bytes) if not isinstance(g.kind, SlidingWindow)) // block_size
    return fixed, per_token
