"""SequenceMemory (state/manager.py): block tables per KV group, all-or-nothing growth, prefix-cache hits (shared
blocks, never the whole prompt, token checks, eviction), sliding windows freeing what they left behind, recurrent
state, and a seeded random workload checked against a model of what each block holds."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from moeserve.state.blocks import prefix_hashes
from moeserve.state.kinds import CacheKind, FullAttention, RecurrentState, SlidingWindow
from moeserve.state.manager import SeqBlocks, SequenceMemory

BS = 16


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def prefill(mem: SequenceMemory, tokens: Sequence[int]) -> SeqBlocks:
    """A sequence that computed all of `tokens` (admitted with whatever hit it gets)."""
    seq = mem.new()
    mem.admit(seq, tokens)
    assert mem.grow(seq, len(tokens))
    mem.computed(seq, tokens, len(tokens))
    return seq


def live(table: list[int]) -> list[int]:
    return [b for b in table if b >= 0]


# ------------------------------------------------------------------------------------------------ growth
@pytest.mark.parametrize("n", [1, 15, 16, 17, 32, 33, 100])
def test_grow_covers_ceil_n_over_block_size_blocks_per_group(n: int) -> None:
    mem = SequenceMemory([FullAttention(), FullAttention()], [10, 12], BS)
    seq = mem.new()
    assert mem.grow(seq, n)
    want = -(-n // BS)
    assert [len(t) for t in seq.tables] == [want, want]
    assert [p.num_used for p in mem.pools] == [want, want]
    assert len(set(seq.tables[0])) == want, "distinct blocks"
    assert mem.grow(seq, n) and [p.num_used for p in mem.pools] == [want, want], "growing to the same size is free"


def test_grow_is_all_or_nothing_when_one_pool_is_short() -> None:
    mem = SequenceMemory([FullAttention(), FullAttention()], [10, 3], BS)
    seq = mem.new()
    assert mem.grow(seq, 20)  # 2 blocks in each group
    before = [list(t) for t in seq.tables]
    assert mem.blocks_short(seq, 64) == 1, "group 1 has 1 free block and needs 2 more"
    assert not mem.grow(seq, 64)
    assert seq.tables == before, "nothing taken from the group that had room"
    assert [p.num_free for p in mem.pools] == [8, 1]
    assert mem.blocks_short(seq, 48) == 0 and mem.grow(seq, 48)
    assert [p.num_free for p in mem.pools] == [7, 0]


def test_free_returns_every_block() -> None:
    mem = SequenceMemory([FullAttention(), SlidingWindow(40)], [20, 20], BS)
    a, b = mem.new(), mem.new()
    assert mem.grow(a, 70) and mem.grow(b, 33)
    mem.computed(a, prompt(70), 70)
    assert mem.usage() == [("full attention", 8, 20), ("sliding window 40", 8 - 1, 20)]  # a's block 0 left the window
    mem.free(a)
    mem.free(b)
    assert a.tables == [[], []] and a.hashes == [] and not a.held
    assert all(p.num_free == p.num_blocks == 20 for p in mem.pools)
    for p in mem.pools:
        p.check()
    mem.free(a)  # freeing again gives back nothing twice
    assert all(p.num_free == 20 for p in mem.pools)


# ------------------------------------------------------------------------------------------------ prefix hits
def test_a_repeated_prompt_shares_its_full_blocks() -> None:
    mem = SequenceMemory([FullAttention()], [16], BS)
    toks = prompt(56)  # 3.5 blocks
    first = prefill(mem, toks)
    second = mem.new()
    assert mem.admit(second, toks) == 48
    assert second.tables[0] == first.tables[0][:3], "the same block ids"
    assert all(mem.pools[0].refs(b) == 2 for b in first.tables[0][:3])
    assert mem.pools[0].refs(first.tables[0][3]) == 1, "the partial last block is not shared"
    assert mem.pools[0].num_used == 4, "the hit takes no new block"
    assert mem.grow(second, 56) and mem.pools[0].num_used == 5 and second.tables[0][3] != first.tables[0][3]
    assert second.hashes == first.hashes[:3]


def test_a_prompt_of_whole_blocks_leaves_its_last_block_to_compute() -> None:
    mem = SequenceMemory([FullAttention()], [16], BS)
    toks = prompt(64)  # exactly 4 blocks, all registered by the first sequence
    first = prefill(mem, toks)
    assert len(first.hashes) == 4 and mem.pools[0].num_cached == 4
    second = mem.new()
    assert mem.admit(second, toks) == 48, "the last token must be computed to give the first logits"
    assert len(second.tables[0]) == 3
    third = mem.new()
    assert mem.admit(third, toks[:17]) == 16 and mem.admit(mem.new(), toks[:16]) == 0


def test_no_hit_without_prefix_caching() -> None:
    mem = SequenceMemory([FullAttention()], [16], BS, prefix_caching=False)
    toks = prompt(56)
    first = prefill(mem, toks)
    assert first.hashes == [] and mem.pools[0].num_cached == 0
    second = mem.new()
    assert mem.admit(second, toks) == 0 and not second.held


def test_a_changed_token_limits_the_hit_to_the_blocks_before_it() -> None:
    mem = SequenceMemory([FullAttention()], [16], BS)
    toks = prompt(56)
    first = prefill(mem, toks)
    other = list(toks)
    other[BS + 5] += 1  # in block 1
    second = mem.new()
    assert mem.admit(second, other) == BS and second.tables[0] == first.tables[0][:1]
    changed_first = list(toks)
    changed_first[0] += 1  # every later block's hash chains through block 0
    assert mem.admit(mem.new(), changed_first) == 0


def test_evicted_blocks_are_not_hit_and_a_prefix_tail_goes_first() -> None:
    mem = SequenceMemory([FullAttention()], [6], BS)
    pool = mem.pools[0]
    toks = prompt(56)  # blocks 0..2 registered, 3 partial
    first = prefill(mem, toks)
    mem.free(first)
    assert pool.num_free == 6 and pool.num_cached == 3
    # Free order: the 2 never used blocks, then first's blocks tail first (3, 2, 1, 0).
    filler = mem.new()
    assert mem.grow(filler, 3 * BS)  # 2 unused + the partial block 3: no cached prefix lost yet
    assert pool.evictions == 0 and mem.admit(mem.new(), toks) == 48
    mem.free(filler)
    # The hit above was taken and dropped; take 2 blocks more than the cold ones: evicts block 2 (the tail).
    mem = SequenceMemory([FullAttention()], [6], BS)
    pool = mem.pools[0]
    first = prefill(mem, toks)
    mem.free(first)
    filler = mem.new()
    assert mem.grow(filler, 4 * BS)
    assert pool.evictions == 1
    probe = mem.new()
    assert mem.admit(probe, toks) == 32, "blocks 0 and 1 survive; block 2 was evicted"
    mem.free(probe)
    mem.free(filler)
    filler = mem.new()
    assert mem.grow(filler, 6 * BS)  # everything reused
    assert pool.num_cached == 0 and mem.admit(mem.new(), toks) == 0


# ------------------------------------------------------------------------------------------------ windows
def test_a_sliding_window_frees_the_blocks_it_left_behind() -> None:
    w = 32
    mem = SequenceMemory([SlidingWindow(w)], [10], BS)
    pool = mem.pools[0]
    toks = prompt(200)
    seq = mem.new()
    done = 0
    for chunk in [20, 30, 1, 1, 48, 1]:
        assert mem.grow(seq, done + chunk)
        done += chunk
        mem.computed(seq, toks, done)
        first_live = max(0, done - w + 1) // BS
        table = seq.tables[0]
        assert len(table) == -(-done // BS)
        assert all(b == -1 for b in table[:first_live]) and all(b >= 0 for b in table[first_live:])
        assert pool.num_used == len(table) - first_live
        pool.check()
    # Freed blocks keep their registration (another sequence with this prefix can take them back).
    assert pool.num_cached == done // BS
    mem.free(seq)
    assert pool.num_free == 10


def test_a_mixed_hit_needs_only_the_windows_blocks_in_the_sliding_group() -> None:
    w = 20
    mem = SequenceMemory([FullAttention(), SlidingWindow(w)], [16, 16], BS)
    full, sliding = mem.pools
    toks = prompt(80)  # 5 full blocks
    first = prefill(mem, toks)
    # After 80 tokens the window [61, 80] starts in block 3: blocks 0..2 of the sliding group are free.
    tables = [list(t) for t in first.tables]
    assert tables[1][:3] == [-1, -1, -1] and live(tables[1]) == tables[1][3:] and sliding.num_used == 2
    mem.free(first)
    # Evict the sliding group's blocks 0..2 (its LRU order frees them first: they left the window first).
    for _ in range(16 - 5):
        sliding.allocate()  # the cold blocks
    for _ in range(3):
        sliding.allocate()
    assert sliding.evictions == 3 and full.evictions == 0
    longer = toks + prompt(10, seed=1)  # 90 tokens: up to 5 blocks may hit
    seq = mem.new()
    assert mem.admit(seq, longer) == 80, "the next token (80) reads [61, 80]: sliding blocks 3 and 4 suffice"
    assert seq.tables[0] == tables[0]
    assert seq.tables[1] == tables[1]
    assert all(sliding.refs(b) == 1 for b in seq.tables[1][3:])
    assert mem.admit(mem.new(), toks[:80]) == 0, "a hit of 64 would read [45, 64]: sliding block 2 is gone"


@pytest.mark.parametrize("evict", ["sliding 0-2", "full 4"])
def test_a_mixed_hit_is_cut_back_to_one_every_group_can_use(evict: str) -> None:
    w = 20
    mem = SequenceMemory([FullAttention(), SlidingWindow(w)], [16, 16], BS)
    full, sliding = mem.pools
    toks = prompt(80)
    first = prefill(mem, toks)
    assert first.tables == [[0, 1, 2, 3, 4], [-1, -1, -1, 3, 4]]  # a fresh pool hands out blocks in order
    mem.free(first)
    if evict == "sliding 0-2":  # the cold blocks, then sliding blocks 0, 1, 2 (freed first: they left the window)
        cases = [(90, 80), (81, 80), (80, 0), (64, 0), (17, 0)]
        taken = [(sliding, sliding.allocate()) for _ in range(16 - 5 + 3)]
    else:  # the cold blocks, then full block 4 (a freed sequence's tail goes first)
        cases = [(90, 64), (80, 64), (65, 64), (64, 48), (49, 48), (48, 32), (17, 16), (16, 0)]
        taken = [(full, full.allocate()) for _ in range(16 - 5 + 1)]
    assert full.evictions + sliding.evictions == (3 if evict == "sliding 0-2" else 1)
    for n, want in cases:
        seq = mem.new()
        got = mem.admit(seq, toks[:n] if n <= 80 else toks + prompt(n - 80, seed=1))
        assert got == want, (n, got)
        k, lo = got // BS, max(0, got - w + 1) // BS
        assert seq.tables[0] == list(range(k)) and seq.tables[1] == [-1] * lo + list(range(lo, k))
        assert all(sliding.refs(b) == 1 for b in live(seq.tables[1])), "a freed cached block taken back"
        assert seq.hashes == prefix_hashes(toks, BS)[:k]
        if n == 90 and evict == "full 4":  # computing block 4 again registers it again
            longer = toks + prompt(10, seed=1)
            for pool, b in taken:
                pool.release(b)
            taken = []
            assert mem.grow(seq, 90)
            mem.computed(seq, longer, 90)
            assert seq.hashes == prefix_hashes(longer, BS) and len(seq.hashes) == 5
            assert full.lookup(seq.hashes[4], toks[64:80]) == seq.tables[0][4]
        mem.free(seq)
    for pool, b in taken:
        pool.release(b)
    for p in mem.pools:
        p.check()
        assert p.num_free == 16


def test_recurrent_state_holds_one_block_and_never_hits() -> None:
    for kinds in ([RecurrentState()], [FullAttention(), RecurrentState()]):
        mem = SequenceMemory(kinds, [16] * len(kinds), BS)
        assert not mem.prefix_caching, "without snapshot slots a recurrent state is only valid where it was left"
        toks = prompt(100)
        a = prefill(mem, toks)
        assert len(a.tables[-1]) == 1 and mem.pools[-1].num_used == 1
        b = mem.new()
        assert mem.admit(b, toks) == 0 and not b.held
        assert mem.grow(b, 1) and len(b.tables[-1]) == 1
        assert mem.grow(b, 100) and len(b.tables[-1]) == 1 and b.tables[-1] != a.tables[-1]
        mem.computed(b, toks, 100)
        assert len(live(b.tables[-1])) == 1, "a recurrent state is never dropped while the sequence runs"
        mem.free(a)
        mem.free(b)
        assert all(p.num_free == 16 for p in mem.pools)
    assert RecurrentState().blocks_for(0, BS) == 0 and RecurrentState().blocks_for(10**6, BS) == 1


def test_max_live_blocks_bounds_what_a_sliding_sequence_holds() -> None:
    """size_pools (state/kv_cache.py) sizes a sliding pool from this bound: check it against the manager."""
    rng = random.Random(3)
    for w in (1, 5, 16, 20, 33, 64):
        kind = SlidingWindow(w)
        mem = SequenceMemory([kind], [64], BS)
        seq, toks, done = mem.new(), prompt(600), 0
        while done < 560:
            n = rng.choice([1, 1, 2, 7, 16, 17, 40])
            assert mem.grow(seq, done + n)
            assert len(live(seq.tables[0])) <= kind.max_live_blocks(n, BS), (w, done, n)
            done += n
            mem.computed(seq, toks, done)


# ------------------------------------------------------------------------------------------------ random
def run_random_workload(kinds: list[CacheKind], sizes: list[int], seed: int, steps: int = 1500) -> dict[str, int]:
    """Sequences from a few shared prompt prefixes are admitted, grown, computed and freed in random order. A model
    of each block's contents checks that no write lands in a shared block and that every hit block holds exactly
    the tokens the sequence would have computed; reference counts are recounted from the live tables."""
    rng = random.Random(seed)
    mem = SequenceMemory(kinds, sizes, BS)
    content = [[[None] * BS for _ in range(n)] for n in sizes]  # what each block holds, per group
    prefixes = [prompt(rng.randrange(20, 90), seed=100 + i) for i in range(4)]
    live_seqs: list[tuple[SeqBlocks, list[int], list[int]]] = []  # (blocks, tokens, [length, computed])
    counts = {"admitted": 0, "hit_tokens": 0, "refused": 0, "freed": 0, "full": 0}

    def write(seq: SeqBlocks, toks: list[int], start: int, end: int) -> None:
        for g, pool in enumerate(mem.pools):
            if isinstance(kinds[g], RecurrentState):
                continue
            for p in range(start, end):
                b = seq.tables[g][p // BS]
                assert b >= 0 and pool.refs(b) == 1, "a write into a shared or freed block"
                content[g][b][p % BS] = toks[p]

    def grown(seq: SeqBlocks, before: list[int]) -> None:
        for g in range(len(sizes)):
            for b in seq.tables[g][before[g]:]:
                if b >= 0:
                    content[g][b] = [None] * BS

    for _ in range(steps):
        op = rng.random()
        if op < 0.3 and len(live_seqs) < 12:
            base = rng.choice(prefixes)
            toks = base[: rng.randrange(1, len(base) + 1)] + prompt(rng.randrange(0, 30), seed=rng.randrange(10**6))
            length = len(toks)
            toks = toks + prompt(60, seed=rng.randrange(10**6))  # what it will "generate"
            seq = mem.new()
            cached = mem.admit(seq, toks[:length])
            assert cached % BS == 0 and cached <= length - 1
            for g, kind in enumerate(kinds):
                lo = kind.first_live_block(cached, BS)
                assert len(seq.tables[g]) == cached // BS
                for i, b in enumerate(seq.tables[g]):
                    assert (b >= 0) == (i >= lo)
                    if b >= 0:
                        assert content[g][b] == toks[i * BS : (i + 1) * BS], "a hit block holds other tokens"
            n = rng.randrange(1, length - cached + 1)
            if mem.grow(seq, cached + n):
                grown(seq, [cached // BS] * len(sizes))
                write(seq, toks, cached, cached + n)
                mem.computed(seq, toks[:length], cached + n)
                assert not mem.prefix_caching or seq.hashes == prefix_hashes(toks[: cached + n], BS)
                live_seqs.append((seq, toks, [length, cached + n]))
                counts["admitted"] += 1
                counts["hit_tokens"] += cached
            else:
                mem.free(seq)
                counts["refused"] += 1
        elif op < 0.85 and live_seqs:
            seq, toks, state = rng.choice(live_seqs)
            length, done = state
            if done == length:  # decode: one more token
                if length == len(toks):
                    continue
                length += 1
            n = rng.randrange(1, length - done + 1)
            before = [len(t) for t in seq.tables]
            if not mem.grow(seq, done + n):
                assert [len(t) for t in seq.tables] == before
                counts["full"] += 1
                continue
            grown(seq, before)
            write(seq, toks, done, done + n)
            mem.computed(seq, toks[:length], done + n)
            state[:] = [length, done + n]
            if mem.prefix_caching:
                assert seq.hashes == prefix_hashes(toks[: done + n], BS), "hashes of the computed full blocks"
        elif live_seqs:
            seq, _, _ = live_seqs.pop(rng.randrange(len(live_seqs)))
            mem.free(seq)
            counts["freed"] += 1
        for g, pool in enumerate(mem.pools):
            pool.check()
            held = [b for s, _, _ in live_seqs for b in s.tables[g] if b >= 0]
            assert all(pool.refs(b) == held.count(b) for b in range(pool.num_blocks))
            assert pool.num_used == len(set(held))
    for seq, _, _ in live_seqs:
        mem.free(seq)
    for pool in mem.pools:
        pool.check()
        assert pool.num_free == pool.num_blocks and all(pool.refs(b) == 0 for b in range(pool.num_blocks))
    counts["evictions"] = sum(p.evictions for p in mem.pools)
    return counts


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("kinds", [[FullAttention()], [FullAttention(), SlidingWindow(24)], [SlidingWindow(40)],
                                   [FullAttention(), RecurrentState()]], ids=["full", "mixed", "sliding", "recurrent"])
def test_random_workload_never_double_frees_and_gives_everything_back(kinds: list[CacheKind], seed: int) -> None:
    counts = run_random_workload(kinds, [20] * len(kinds), seed)
    assert counts["admitted"] > 50 and counts["freed"] > 50 and counts["full"] > 0, counts
    if not any(isinstance(k, RecurrentState) for k in kinds):
        assert counts["hit_tokens"] > 0 and counts["evictions"] > 0, counts
