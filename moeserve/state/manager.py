"""The block manager: which KV blocks each sequence holds, in every KV group. Pure Python (no torch).

One `BlockPool` per KV group (state/kinds.py says what each group's layers keep). A sequence's `SeqBlocks` has one
block table per group: entry i is the block holding its tokens [i * block_size, (i + 1) * block_size), or -1 where
its kind no longer reads them (a sliding window past them). The scheduler (engine/scheduler.py) calls:

    cached = memory.admit(blocks, prompt)      # prefix-cache hit: full blocks another sequence computed, taken
    ok = memory.grow(blocks, num_tokens)       # tables cover [0, num_tokens) in every group, or nothing changes
    memory.computed(blocks, tokens, n)         # tokens [0, n) are in the cache: register full blocks, free the
                                               # blocks a sliding window left behind
    memory.free(blocks)                        # finished, aborted or preempted

Prefix caching (`prefix_caching`): the hit is the longest run of full prompt blocks every group can use (a full-
attention group needs all of them, a sliding group only those inside the window of the first uncached token),
never the whole prompt (its last token must be computed to give the first logits). Freed blocks are returned
tail first, so under pressure a prefix's last blocks are evicted before its first ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from moeserve.state.blocks import ROOT_HASH, BlockPool, block_hash
from moeserve.state.kinds import CacheKind


@dataclass
class SeqBlocks:
    """A sequence's share of the pools."""

    tables: list[list[int]]  # per group
    hashes: list[int] = field(default_factory=list)  # chained hashes of its full blocks computed so far

    @property
    def held(self) -> bool:
        return any(t for t in self.tables)


@dataclass
class PrefixStats:
    """Counted by the scheduler at each admission that holds (a failed one is tried again)."""

    queried_tokens: int = 0  # prompt tokens looked up at admission
    hit_tokens: int = 0  # of which found computed

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class SequenceMemory:
    def __init__(self, kinds: Sequence[CacheKind], num_blocks: Sequence[int], block_size: int,
                 prefix_caching: bool = True) -> None:
        if len(kinds) != len(num_blocks) or not kinds:
            raise ValueError("one block count per KV group, at least one group")
        self.kinds = list(kinds)
        self.block_size = block_size
        self.pools = [BlockPool(n, block_size) for n in num_blocks]
        self.prefix_caching = prefix_caching and all(k.caches_prefixes for k in kinds)
        self.stats = PrefixStats()

    def new(self) -> SeqBlocks:
        return SeqBlocks([[] for _ in self.pools])

    # ---------------------------------------------------------------------------------------- admission
    def admit(self, seq: SeqBlocks, prompt: Sequence[int]) -> int:
        """Take the cached blocks of the longest usable prefix of `prompt`; returns how many tokens they hold."""
        assert not seq.held, "admit a sequence that holds no blocks"
        if not self.prefix_caching:
            return 0
        bs = self.block_size
        hashes: list[int] = []
        found: list[list[int | None]] = [[] for _ in self.pools]
        parent = ROOT_HASH
        for i in range((len(prompt) - 1) // bs):  # never the whole prompt
            tokens = prompt[i * bs : (i + 1) * bs]
            parent = block_hash(parent, tokens)
            hits = [pool.lookup(parent, tokens) for pool in self.pools]
            if all(h is None for h in hits):
                break
            hashes.append(parent)
            for g, h in enumerate(hits):
                found[g].append(h)
        k = len(hashes)
        while k > 0 and not all(kind.usable_hit(f, k, bs) for kind, f in zip(self.kinds, found)):
            k -= 1
        for g, (kind, pool) in enumerate(zip(self.kinds, self.pools)):
            lo = kind.first_live_block(k * bs, bs)
            table = seq.tables[g]
            for i in range(k):
                block = found[g][i]
                if i >= lo and block is not None:
                    pool.take(block)
                    table.append(block)
                else:
                    table.append(-1)
        seq.hashes = hashes[:k]
        return k * bs

    def prefill_end(self, start: int, end: int, prompt_len: int) -> int:
        """Where a prefill chunk meant to compute tokens [start, end) ends so that every kind can take it
        (CacheKind.prefill_end: a recurrent layer's chunk grid); `end` for attention-only models."""
        return min(kind.prefill_end(start, end, prompt_len) for kind in self.kinds)

    # -------------------------------------------------------------------------------------------- growth
    def blocks_short(self, seq: SeqBlocks, num_tokens: int) -> int:
        """Blocks missing (in the group that lacks the most) for `seq` to cover `num_tokens` tokens."""
        short = 0
        for g, (kind, pool) in enumerate(zip(self.kinds, self.pools)):
            need = kind.blocks_for(num_tokens, self.block_size) - len(seq.tables[g])
            short = max(short, need - pool.num_free)
        return short

    def grow(self, seq: SeqBlocks, num_tokens: int) -> bool:
        """Extend every table to cover tokens [0, num_tokens); False (nothing taken) when a pool is short."""
        if self.blocks_short(seq, num_tokens) > 0:
            return False
        for g, (kind, pool) in enumerate(zip(self.kinds, self.pools)):
            table = seq.tables[g]
            while len(table) < kind.blocks_for(num_tokens, self.block_size):
                table.append(pool.allocate())
        return True

    def computed(self, seq: SeqBlocks, tokens: Sequence[int], num_computed: int) -> None:
        """Tokens [0, num_computed) of `tokens` are in the cache: register their new full blocks for reuse, then
        free what a sliding window no longer reads."""
        bs = self.block_size
        if self.prefix_caching:
            parent = seq.hashes[-1] if seq.hashes else ROOT_HASH
            for i in range(len(seq.hashes), num_computed // bs):
                block_tokens = tokens[i * bs : (i + 1) * bs]
                parent = block_hash(parent, block_tokens)
                seq.hashes.append(parent)
                for g, pool in enumerate(self.pools):
                    if seq.tables[g][i] >= 0:
                        pool.register(seq.tables[g][i], parent, block_tokens)
        for g, (kind, pool) in enumerate(zip(self.kinds, self.pools)):
            table = seq.tables[g]
            for i in range(min(kind.first_live_block(num_computed, bs), len(table))):
                if table[i] >= 0:
                    pool.release(table[i])
                    table[i] = -1

    def free(self, seq: SeqBlocks) -> None:
        """Give back every block (tail first: the LRU reuses a prefix's last blocks before its first)."""
        for g, pool in enumerate(self.pools):
            for block in reversed(seq.tables[g]):
                if block >= 0:
                    pool.release(block)
            seq.tables[g] = []
        seq.hashes = []

    # ------------------------------------------------------------------------------------------ reporting
    def usage(self) -> list[tuple[str, int, int]]:
        """(kind, blocks used, blocks in the pool) per group."""
        return [(kind.describe(), pool.num_used, pool.num_blocks) for kind, pool in zip(self.kinds, self.pools)]
