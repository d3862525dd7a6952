"""A pool of fixed-size KV blocks with reference counts and a prefix cache. Pure Python (no torch).

Each block holds the keys and values of `block_size` consecutive tokens of one sequence (in every layer of its
KV group: state/kv_cache.py holds the tensors; this module only decides which block ids are in use).

- A block in use has a reference count: one per sequence whose block table lists it (sequences sharing a prompt
  prefix share its blocks).
- A full block whose tokens are computed can be registered under the hash of its whole token prefix (`register`):
  a later sequence with the same prefix takes it instead of computing it again (`lookup`). The hash chains the
  parent block's hash and this block's tokens; the tokens are kept and compared on lookup, so a hash collision
  can never hand a sequence another prefix's keys.
- A block whose count falls to 0 goes to the free list in least-recently-freed order, keeping its hash: it can
  still be found and taken back until `allocate` reuses it (the oldest first: LRU eviction of cached prefixes).
- Two sequences that computed the same prefix at the same time both register their block: when one copy is
  evicted the other is still found (a held copy is preferred, so a free one is not taken off the free list).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

ROOT_HASH = 0  # parent hash of a sequence's first block


def block_hash(parent: int, tokens: Sequence[int]) -> int:
    """The hash of a full block's token prefix: its parent block's hash and its own tokens."""
    return hash((parent, tuple(tokens)))


def prefix_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of every full block of `tokens`."""
    out: list[int] = []
    parent = ROOT_HASH
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[start : start + block_size])
        out.append(parent)
    return out


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a block pool needs at least one block of at least one token ({num_blocks=}, "
                             f"{block_size=})")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._refs = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # oldest first
        self._key: list[tuple[int, tuple[int, ...]] | None] = [None] * num_blocks  # (hash, tokens) if registered
        self._by_hash: dict[int, dict[int, None]] = {}  # hash -> its registered blocks, in registration order
        self._registered = 0
        self.evictions = 0  # registered blocks reused for other tokens

    # ------------------------------------------------------------------------------------------ counts
    @property
    def num_free(self) -> int:
        """Blocks no sequence holds (cached prefixes among them: they are reused last)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        """Registered blocks, held or free."""
        return self._registered

    def refs(self, block: int) -> int:
        return self._refs[block]

    # ------------------------------------------------------------------------------------------ changes
    def allocate(self) -> int:
        """A fresh block (count 1): the least recently freed one; a cached prefix in it is forgotten."""
        if not self._free:
            raise RuntimeError("no free KV block")  # callers check num_free first
        block, _ = self._free.popitem(last=False)
        key = self._key[block]
        if key is not None:
            copies = self._by_hash[key[0]]
            del copies[block]
            if not copies:
                del self._by_hash[key[0]]
            self._key[block] = None
            self._registered -= 1
            self.evictions += 1
        self._refs[block] = 1
        return block

    def take(self, block: int) -> None:
        """One more holder of `block` (a cached block taken back from the free list, or a shared one)."""
        if self._refs[block] == 0:
            del self._free[block]
        self._refs[block] += 1

    def release(self, block: int) -> None:
        """One holder less; at zero the block is free (its cached prefix kept until the block is reused)."""
        if self._refs[block] <= 0:
            raise RuntimeError(f"KV block {block} released more often than taken")
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free[block] = None

    def register(self, block: int, hash_: int, tokens: Sequence[int]) -> None:
        """`block` holds the computed full block `tokens` whose prefix hashes to `hash_` (another block may hold
        the same prefix: a sequence that computed it at the same time)."""
        if self._key[block] is not None:
            return
        self._key[block] = (hash_, tuple(tokens))
        self._by_hash.setdefault(hash_, {})[block] = None
        self._registered += 1

    def lookup(self, hash_: int, tokens: Sequence[int]) -> int | None:
        """A block registered for this prefix hash with exactly these tokens (a held one first), or None. Does not
        take it."""
        wanted = tuple(tokens)
        found = [b for b in self._by_hash.get(hash_, ()) if self._key[b][1] == wanted]  # type: ignore[index]
        return next((b for b in found if self._refs[b] > 0), found[0] if found else None)

    def check(self) -> None:
        """Internal consistency (tests): free blocks have count 0, held ones are not free, hashes map both ways."""
        for b in range(self.num_blocks):
            assert (self._refs[b] == 0) == (b in self._free), b
            key = self._key[b]
            assert key is None or b in self._by_hash[key[0]], b
        assert all(self._key[b] is not None and self._key[b][0] == h  # type: ignore[index]
                   for h, blocks in self._by_hash.items() for b in blocks)
        assert self._registered == sum(k is not None for k in self._key)
