"""BlockPool (state/blocks.py): reference counts, LRU reuse of freed blocks, the prefix cache (register, lookup,
eviction on reuse), and a seeded random walk checked operation by operation against a plain reference model."""

from __future__ import annotations

import random

import pytest

from moeserve.state.blocks import ROOT_HASH, BlockPool, block_hash, prefix_hashes


def test_allocate_take_release_count_holders() -> None:
    pool = BlockPool(4, 16)
    assert (pool.num_free, pool.num_used, pool.num_cached) == (4, 0, 0)
    a = pool.allocate()
    assert pool.refs(a) == 1 and (pool.num_free, pool.num_used) == (3, 1)
    pool.take(a)
    assert pool.refs(a) == 2 and pool.num_free == 3, "a second holder does not use another block"
    pool.release(a)
    assert pool.refs(a) == 1 and pool.num_free == 3, "still held by one"
    pool.release(a)
    assert pool.refs(a) == 0 and pool.num_free == 4
    blocks = [pool.allocate() for _ in range(4)]
    assert sorted(blocks) == [0, 1, 2, 3] and pool.num_free == 0
    with pytest.raises(RuntimeError, match="no free KV block"):
        pool.allocate()
    pool.check()


def test_release_more_than_taken_raises() -> None:
    pool = BlockPool(2, 4)
    b = pool.allocate()
    pool.take(b)
    pool.release(b)
    pool.release(b)
    with pytest.raises(RuntimeError, match="released more often than taken"):
        pool.release(b)
    with pytest.raises(RuntimeError):
        pool.release(1 - b)  # never allocated
    assert pool.num_free == 2
    pool.check()


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError):
        BlockPool(0, 16)
    with pytest.raises(ValueError):
        BlockPool(4, 0)


def test_freed_blocks_are_reused_least_recently_freed_first() -> None:
    pool = BlockPool(5, 4)
    assert [pool.allocate() for _ in range(5)] == [0, 1, 2, 3, 4], "a fresh pool hands out blocks in order"
    for b in (3, 0, 4, 1, 2):
        pool.release(b)
    assert [pool.allocate() for _ in range(5)] == [3, 0, 4, 1, 2]
    # Taking a free block back removes it from the LRU order; the others keep theirs.
    for b in (2, 1, 0):
        pool.release(b)
    pool.take(1)
    assert pool.allocate() == 2 and pool.allocate() == 0 and pool.num_free == 0
    pool.check()


def test_a_registered_block_freed_keeps_its_hash_and_can_be_taken_back() -> None:
    pool = BlockPool(3, 4)
    tokens = [5, 6, 7, 8]
    h = block_hash(ROOT_HASH, tokens)
    b = pool.allocate()
    pool.register(b, h, tokens)
    assert pool.num_cached == 1 and pool.lookup(h, tokens) == b
    assert pool.refs(b) == 1, "lookup does not take the block"
    pool.release(b)
    assert pool.num_free == 3 and pool.lookup(h, tokens) == b, "a free cached block is still found"
    pool.take(b)
    assert pool.refs(b) == 1 and pool.num_free == 2
    # Held again, it is not handed out: the other two are.
    assert {pool.allocate(), pool.allocate()} == {0, 1, 2} - {b}
    assert pool.lookup(h, tokens) == b and pool.evictions == 0
    pool.check()


def test_allocating_a_cached_free_block_evicts_its_prefix() -> None:
    pool = BlockPool(2, 2)
    a, b = pool.allocate(), pool.allocate()
    ha, hb = block_hash(ROOT_HASH, [1, 2]), block_hash(ROOT_HASH, [3, 4])
    pool.register(a, ha, [1, 2])
    pool.register(b, hb, [3, 4])
    pool.release(b)
    pool.release(a)  # b is the least recently freed: reused first
    assert pool.allocate() == b
    assert pool.lookup(hb, [3, 4]) is None and pool.evictions == 1 and pool.num_cached == 1
    assert pool.lookup(ha, [1, 2]) == a, "the other cached block is untouched"
    # The reused block can be registered again under another prefix.
    pool.register(b, ha + 1, [9, 9])
    assert pool.lookup(ha + 1, [9, 9]) == b
    pool.release(b)
    assert pool.allocate() == a and pool.allocate() == b  # a was freed before b
    assert pool.evictions == 3 and pool.num_cached == 0
    # Reusing a block that was never registered is not an eviction.
    pool.release(a)
    assert pool.allocate() == a and pool.evictions == 3
    pool.check()


def test_lookup_compares_tokens_not_only_the_hash() -> None:
    pool = BlockPool(2, 3)
    b = pool.allocate()
    pool.register(b, 12345, [1, 2, 3])
    assert pool.lookup(12345, [1, 2, 3]) == b
    assert pool.lookup(12345, [1, 2, 4]) is None, "same hash, other tokens: a collision must not hit"
    assert pool.lookup(12345, (1, 2, 3)) == b, "any sequence type of the same tokens"
    assert pool.lookup(54321, [1, 2, 3]) is None


def test_both_copies_of_a_prefix_computed_at_once_are_found_and_a_block_keeps_its_first_prefix() -> None:
    pool = BlockPool(3, 2)
    a, b = pool.allocate(), pool.allocate()
    pool.register(a, 7, [1, 1])
    pool.register(b, 7, [1, 1])  # another sequence computed the same prefix at the same time
    assert pool.lookup(7, [1, 1]) == a and pool.num_cached == 2
    pool.register(a, 8, [2, 2])  # a block keeps the prefix it was registered under
    assert pool.lookup(8, [2, 2]) is None and pool.lookup(7, [1, 1]) == a
    pool.check()
    pool.release(a)  # the first copy is freed first, so evicted first
    assert pool.lookup(7, [1, 1]) == b, "a held copy before a free one (taking a free one shrinks the free list)"
    pool.release(b)
    c = pool.allocate()  # the never-used block
    assert c not in (a, b) and pool.allocate() == a  # now the first copy is evicted ...
    assert pool.lookup(7, [1, 1]) == b and pool.num_cached == 1  # ... and the second is still found
    pool.check()


def test_prefix_hashes_chain_full_blocks_only() -> None:
    toks = list(range(10))
    hs = prefix_hashes(toks, 4)
    assert len(hs) == 2, "10 tokens: two full blocks of 4, the partial third is not hashed"
    assert hs[0] == block_hash(ROOT_HASH, toks[0:4]) and hs[1] == block_hash(hs[0], toks[4:8])
    assert prefix_hashes(toks[:8], 4) == hs and prefix_hashes(toks[:3], 4) == []
    other = [99] + toks[1:]
    assert prefix_hashes(other, 4)[1] != hs[1], "a changed first block changes every later hash"
    assert prefix_hashes(toks, 4) == hs, "deterministic"


class ReferencePool:
    """What BlockPool should do, written the plain way."""

    def __init__(self, n: int) -> None:
        self.refs = [0] * n
        self.free = list(range(n))  # oldest first
        self.key: dict[int, tuple[int, tuple[int, ...]]] = {}  # block -> (hash, tokens)
        self.evictions = 0

    def allocate(self) -> int:
        b = self.free.pop(0)
        if b in self.key:
            del self.key[b]
            self.evictions += 1
        self.refs[b] = 1
        return b

    def take(self, b: int) -> None:
        if self.refs[b] == 0:
            self.free.remove(b)
        self.refs[b] += 1

    def release(self, b: int) -> None:
        self.refs[b] -= 1
        if self.refs[b] == 0:
            self.free.append(b)

    def register(self, b: int, h: int, tokens: tuple[int, ...]) -> None:
        if b not in self.key:
            self.key[b] = (h, tokens)

    def lookup(self, h: int, tokens: tuple[int, ...]) -> int | None:
        """The first registered block of this prefix that a sequence holds, else the first registered one."""
        found = [b for b, key in self.key.items() if key == (h, tokens)]  # registration order
        held = [b for b in found if self.refs[b] > 0]
        return (held or found or [None])[0]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_walk_matches_the_reference_model(seed: int) -> None:
    rng = random.Random(seed)
    n = 8
    pool, ref = BlockPool(n, 2), ReferencePool(n)
    ops = {"allocate": 0, "take_free": 0, "take_held": 0, "release": 0, "register": 0, "hit": 0, "evict": 0}
    for _ in range(4000):
        held = [b for b in range(n) if ref.refs[b] > 0]
        op = rng.choice(["allocate", "allocate", "take", "release", "release", "register", "lookup"])
        if op == "allocate" and ref.free:
            before = ref.evictions
            assert pool.allocate() == ref.allocate()
            ops["allocate"] += 1
            ops["evict"] += ref.evictions - before
        elif op == "allocate":
            with pytest.raises(RuntimeError):
                pool.allocate()
        elif op == "take":
            b = rng.randrange(n)
            ops["take_free" if ref.refs[b] == 0 else "take_held"] += 1
            pool.take(b)
            ref.take(b)
        elif op == "release" and held:
            b = rng.choice(held)
            pool.release(b)
            ref.release(b)
            ops["release"] += 1
        elif op == "release":
            with pytest.raises(RuntimeError):
                pool.release(rng.randrange(n))
        elif op == "register" and held:
            b, h = rng.choice(held), rng.randrange(12)
            tokens = (rng.randrange(2), rng.randrange(2))
            pool.register(b, h, tokens)
            ref.register(b, h, tokens)
            ops["register"] += 1
        elif op == "lookup":
            h, tokens = rng.randrange(12), (rng.randrange(2), rng.randrange(2))
            found = pool.lookup(h, tokens)
            assert found == ref.lookup(h, tokens)
            ops["hit"] += found is not None
        pool.check()
        assert [pool.refs(b) for b in range(n)] == ref.refs
        assert pool.num_free == len(ref.free) and pool.num_used == n - len(ref.free)
        assert pool.num_cached == len(ref.key) and pool.evictions == ref.evictions
    assert all(v > 20 for v in ops.values()), f"the walk must exercise every path: {ops}"
