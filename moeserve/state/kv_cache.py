"""The paged KV cache: per KV group, one [layers, 2, blocks, kv_heads, block_size, head_dim] tensor.

Layers with the same kind of memory (state/kinds.py: full attention, one sliding window size) form a group; a
group's layers share its block ids (block b of a sequence holds the same tokens in each of them), so a sequence has
one block table per group (state/manager.py decides them). Token at position p of a sequence is at row
`table[p // block_size] * block_size + p % block_size` of its group's layers (its "slot": the C++ ops take these
slots for the writes and the block tables for the reads). The tensors are allocated once at start-up from the
memory split (memory/split.py), so a long run never grows memory.

A recurrent group (state/kinds.py RecurrentState: linear-attention layers) holds no keys or values: per layer, one
state slot per running sequence, a conv tensor [slots, *conv_shape] in the compute dtype and a state tensor
[slots, *state_shape] in fp32 (`recurrent(layer)`); a sequence's block table in that group is its one slot.

A latent group (state/kinds.py LatentKV: multi-head latent attention) holds per layer one tensor
[blocks, block_size, width] (`latent(layer)`): a token's row is its compressed latent and its rotated key, for
every head at once; its blocks are numbered, shared and cached like full attention's. With DeepSeek Sparse
Attention (IndexedLatentKV) each layer also holds the indexer's keys [blocks, block_size, index_width]
(`index_keys(layer)`) on the same block ids.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moeserve.state.kinds import (
    CacheKind,
    FullAttention,
    IndexedLatentKV,
    LatentKV,
    RecurrentState,
    SlidingWindow,
    kind_key,
)


@dataclass(frozen=True)
class KVGroup:
    kind: CacheKind
    layers: tuple[int, ...]


def kv_groups(windows: Sequence[int | None], recurrent: RecurrentState | None = None,
              recurrent_layers: Sequence[int] = (), latent: LatentKV | None = None,
              stateless_layers: Sequence[int] = (), unindexed_layers: Sequence[int] = (),
              heads: dict[int, tuple[int, int]] | None = None) -> list[KVGroup]:
    """Group the layers by kind: `windows[i]` is layer i's sliding window (None: full attention, or the `latent`
    kind when given; the plain latent kind for `unindexed_layers`, GLM-5's layers without an indexer of their own),
    except the `recurrent_layers`, which keep the `recurrent` kind of state, and the `stateless_layers` (no token
    mixer: Nemotron-H's MLP and MoE blocks), which keep nothing and are in no group. `heads`: the layers whose keys
    and values have another (KV heads, head dim) than the model's (Gemma-4's global layers), in groups of their own."""
    kinds: dict[tuple[str, int, tuple[int, int] | None], CacheKind] = {}
    members: dict[tuple[str, int, tuple[int, int] | None], list[int]] = {}
    shapes = heads or {}
    linear, stateless = set(recurrent_layers), set(stateless_layers)
    plain = LatentKV(latent.width) if latent is not None else None
    for layer, window in enumerate(windows):
        if layer in stateless:
            continue
        shape = shapes.get(layer)
        kind: CacheKind = (latent or FullAttention(shape)) if window is None else SlidingWindow(window, shape)
        if layer in unindexed_layers and plain is not None:
            kind = plain
        if layer in linear:
            assert recurrent is not None, "recurrent layers need their state kind"
            kind = recurrent
        key = kind_key(kind)
        kinds.setdefault(key, kind)
        members.setdefault(key, []).append(layer)
    return [KVGroup(kinds[key], tuple(members[key])) for key in sorted(members, key=lambda k: members[k][0])]


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


def group_block_bytes(groups: Sequence[KVGroup], block_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype) -> list[int]:
    """Bytes of one block of each group, in all of its layers (CacheKind.block_bytes)."""
    return [g.kind.block_bytes(len(g.layers), block_size, num_kv_heads, head_dim, dtype.itemsize) for g in groups]


class PagedKVCache:
    def __init__(self, groups: Sequence[KVGroup], num_blocks: Sequence[int], block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.groups, self.num_blocks, self.block_size = list(groups), list(num_blocks), block_size
        self._group_of: dict[int, int] = {}
        self._layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._tensors: list[torch.Tensor] = []
        self._latent: dict[int, torch.Tensor] = {}
        self._index_keys: dict[int, torch.Tensor] = {}
        self._by_block: dict[int, list[tuple[torch.Tensor, int]]] = {}  # group -> (tensor, its block dim)
        for g, (group, n) in enumerate(zip(self.groups, self.num_blocks)):
            if isinstance(group.kind, RecurrentState):  # the one kind whose memory is not rows of K and V
                self._add_recurrent(g, group, group.kind, n, dtype, device)
                continue
            if isinstance(group.kind, LatentKV):  # one row per token for every head: no K and V
                self._add_latent(g, group, group.kind, n, dtype, device)
                continue
            heads, dim = group.kind.heads or (num_kv_heads, head_dim)
            kv = torch.zeros((len(group.layers), 2, n, heads, block_size, dim), dtype=dtype, device=device)
            self._tensors.append(kv)
            self._by_block[g] = [(kv, 2)]
            for i, layer in enumerate(group.layers):
                self._group_of[layer] = g
                self._layers[layer] = (kv[i, 0], kv[i, 1])  # views made once: slicing costs ~10 us per call

    def _add_recurrent(self, g: int, group: KVGroup, kind: RecurrentState, slots: int, dtype: torch.dtype,
                       device: torch.device) -> None:
        conv = torch.zeros((len(group.layers), slots, *kind.conv_shape), dtype=dtype, device=device)
        state = torch.zeros((len(group.layers), slots, *kind.state_shape), dtype=torch.float32, device=device)
        self._tensors += [conv, state]
        self._by_block[g] = [(conv, 1), (state, 1)]
        for i, layer in enumerate(group.layers):
            self._group_of[layer] = g
            self._layers[layer] = (conv[i], state[i])

    def _add_latent(self, g: int, group: KVGroup, kind: LatentKV, blocks: int, dtype: torch.dtype,
                    device: torch.device) -> None:
        latent = torch.zeros((len(group.layers), blocks, self.block_size, kind.width), dtype=dtype, device=device)
        self._tensors.append(latent)
        self._by_block[g] = [(latent, 1)]
        keys = None
        if isinstance(kind, IndexedLatentKV):
            keys = torch.zeros((len(group.layers), blocks, self.block_size, kind.index_width), dtype=dtype,
                               device=device)
            self._tensors.append(keys)
            self._by_block[g].append((keys, 1))
        for i, layer in enumerate(group.layers):
            self._group_of[layer] = g
            self._latent[layer] = latent[i]
            if keys is not None:
                self._index_keys[layer] = keys[i]

    def latent(self, layer: int) -> torch.Tensor:
        """The latent rows [blocks, block_size, width] of a multi-head-latent-attention `layer`."""
        return self._latent[layer]

    def index_keys(self, layer: int) -> torch.Tensor:
        """The lightning indexer's keys [blocks, block_size, index_width] of a DeepSeek-Sparse-Attention `layer`."""
        return self._index_keys[layer]

    def recurrent(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv inputs [slots, *conv_shape], state [slots, *state_shape] fp32) of a recurrent `layer`."""
        return self._layers[layer]

    def copy_blocks(self, copies: Sequence[tuple[int, int, int]]) -> None:
        """For each (group, src, dst) in order: block (a recurrent group: state slot) `dst` of every layer of the
        group takes the contents of `src` (SequenceMemory.take_copies: prefix snapshots saved and restored)."""
        for g, src, dst in copies:
            for tensor, dim in self._by_block[g]:
                tensor.select(dim, dst).copy_(tensor.select(dim, src))

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
        live = group.kind.fixed_blocks(max_num_seqs, max_num_batched_tokens, block_size)
        if live is not None:
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
    is_fixed = [g.kind.fixed_blocks(max_num_seqs, max_num_batched_tokens, block_size) is not None for g in groups]
    fixed = sum(n * b for f, n, b in zip(is_fixed, sizes, block_bytes) if f)
    per_token = sum(b for f, b in zip(is_fixed, block_bytes) if not f) // block_size
    return fixed, per_token


SNAPSHOTS_PER_SEQ = 1  # a step holds at most one restore per admitted sequence until its copies are made


def prefix_snapshots(max_num_seqs: int, prefix_caching: bool) -> int:
    """Snapshot slots a recurrent group keeps beside its `max_num_seqs` running slots (0: no prefix caching):
    SNAPSHOTS_PER_SEQ per running sequence, so the snapshots held from admission until the engine copies them (one
    per admitted sequence: saves are copied as soon as they are planned) never take a running sequence's slot; the
    rest keep the most recently used shared prefixes. Each costs a running sequence's state (Qwen3.5-35B-A3B:
    ~61 MiB), taken from the KV pool."""
    return SNAPSHOTS_PER_SEQ * max_num_seqs if prefix_caching else 0


def snapshot_line(groups: Sequence[KVGroup], block_bytes: Sequence[int], max_num_seqs: int,
                  block_size: int) -> str | None:
    """The start-up line of the recurrent prefix snapshots (None: the model keeps none)."""
    for group, nbytes in zip(groups, block_bytes):
        kind = group.kind
        if isinstance(kind, RecurrentState) and kind.snapshots:
            every = math.lcm(block_size, kind.prefill_chunk)
            return (f"{kind.snapshots} recurrent-state slots ({kind.snapshots * nbytes / 2**20:.1f} MiB of the KV "
                    f"budget) beside the {max_num_seqs} running ones: {SNAPSHOTS_PER_SEQ} per running sequence (one "
                    f"held per admission until copied), taken at multiples of {every} tokens (the block size on "
                    f"the {kind.prefill_chunk}-position chunk grid) where a prompt leaves a prefix an earlier one "
                    f"computed, evicted least recently used; enable_prefix_caching=false gives them to the KV pool")
    return None
