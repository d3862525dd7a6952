"""The block manager: which KV blocks each sequence holds, in every KV group. Pure Python (no torch).

One `BlockPool` per KV group (state/kinds.py says what each group's layers keep). A sequence's `SeqBlocks` has one
block table per group: entry i is the block holding its tokens [i * block_size, (i + 1) * block_size), or -1 where
its kind no longer reads them (a sliding window past them). The scheduler (engine/scheduler.py) calls:

    cached = memory.admit(blocks, tokens, p)   # prefix-cache hit: full blocks another sequence computed, taken
    end = memory.prefill_end(s, e, p, blocks)  # where a prefill chunk [s, e) of a prompt of p tokens must end
    ok = memory.grow(blocks, num_tokens)       # tables cover [0, num_tokens) in every group, or nothing changes
    copies = memory.take_copies()              # (group, from block, to block): the engine copies them at once,
                                               # before a forward (snapshots restored) and after `computed` (saved)
    memory.computed(blocks, tokens, n, p)      # tokens [0, n) are in the cache: register full blocks, save a
                                               # snapshot, free the blocks a sliding window left behind
    memory.free(blocks)                        # finished, aborted or preempted

Prefix caching (`prefix_caching`): the hit is the longest run of full prompt blocks every group can use (a full-
attention group needs all of them, a sliding group only those inside the window of the first uncached token),
never the whole prompt (its last token must be computed to give the first logits). Freed blocks are returned
tail first, so under pressure a prefix's last blocks are evicted before its first ones.

Recurrent groups (kinds whose table is a state slot, not token blocks) cache prefixes as snapshots: a copy of the
state where a prompt chunk ended on a snapshot point, registered under that block's prefix hash in the group's
pool; a hit must end on one (`CacheKind.usable_hit`) and copies it into the sequence's new slot. At admission a
sequence plans where else to leave one (`snapshot_cuts`: where its prompt leaves the cached prefix it shares with
an earlier one), and its prefill chunk ends there (`prefill_end`). With such a group no hit or registered block
reaches past a prompt (`CacheKind.decode_differs`).
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
    restores: list[tuple[int, int]] = field(default_factory=list)  # (group, snapshot held) to copy into its slot
    cuts: list[int] = field(default_factory=list)  # positions where a prefill chunk ends to leave a snapshot

    @property
    def held(self) -> bool:
        return any(t for t in self.tables)


@dataclass
class PrefixStats:
    """Counted by the scheduler at each admission that holds (a failed one is tried again)."""

    queried_tokens: int = 0  # prompt tokens looked up at admission
    hit_tokens: int = 0  # of which found computed
    snapshots_saved: int = 0  # recurrent states copied out at a snapshot point
    snapshots_restored: int = 0  # snapshots copied into an admitted sequence's slot

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
        self.decode_differs = any(k.decode_differs for k in kinds)
        self.written_in_place = any(k.written_in_place for k in kinds)
        self.stats = PrefixStats()
        self._copies: list[tuple[int, int, int]] = []  # (group, from block, to block), for the next forward
        self._held: list[tuple[int, int]] = []  # (group, block) held until its copy is taken

    def new(self) -> SeqBlocks:
        return SeqBlocks([[] for _ in self.pools])

    # ---------------------------------------------------------------------------------------- admission
    def admit(self, seq: SeqBlocks, prompt: Sequence[int], prompt_len: int | None = None,
              shared_later: bool = False) -> int:
        """Take the cached blocks of the longest usable prefix of `prompt` (a sequence's tokens, of which the first
        `prompt_len` are its prompt: all when None); returns how many tokens they hold. `shared_later`: other
        sequences will take this prompt (a request's n > 1 siblings): it leaves a snapshot as near its end as
        they can use."""
        assert not seq.held, "admit a sequence that holds no blocks"
        if not self.prefix_caching:
            return 0
        bs = self.block_size
        prompt_len = len(prompt) if prompt_len is None else prompt_len
        limit = (len(prompt) - 1) // bs  # never the whole prompt
        if self.decode_differs:
            limit = min(limit, prompt_len // bs)
        hashes, found = self._lookup(prompt, limit)
        k = len(hashes)
        while k > 0 and not all(kind.usable_hit(f, k, bs) for kind, f in zip(self.kinds, found)):
            k -= 1
        for g, (kind, pool) in enumerate(zip(self.kinds, self.pools)):
            restore = kind.restore_block(found[g], k)
            if restore is not None:
                pool.take(restore)  # held until its copy into the sequence's slot is taken
                seq.restores.append((g, restore))
            if not kind.holds_token_blocks:
                continue
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
        shared = max(len(hashes) * bs, (prompt_len - 1) // bs * bs if shared_later else 0)
        seq.cuts = self.snapshot_cuts(k * bs, shared, prompt_len)
        return k * bs

    def _lookup(self, prompt: Sequence[int], limit: int) -> tuple[list[int], list[list[int | None]]]:
        """(hashes, found[group][i]: the cached block of full block i or None) of the prompt's first full blocks,
        up to `limit` of them, while some group has them."""
        bs = self.block_size
        hashes: list[int] = []
        found: list[list[int | None]] = [[] for _ in self.pools]
        parent = ROOT_HASH
        for i in range(limit):
            tokens = prompt[i * bs : (i + 1) * bs]
            parent = block_hash(parent, tokens)
            hits = [pool.lookup(parent, tokens) for pool in self.pools]
            if all(h is None for h in hits):
                break
            hashes.append(parent)
            for g, h in enumerate(hits):
                found[g].append(h)
        return hashes, found

    def snapshot_cuts(self, hit: int, shared: int, prompt_len: int) -> list[int]:
        """Where a prefill chunk of a sequence admitted with a `hit` ends to leave a snapshot: the last snapshot
        point past the hit within the `shared` tokens whose blocks an earlier sequence computed (a prefix seen
        twice, such as a system prompt or the previous turn of a conversation: the next prompt with it resumes
        there). Never a cut in a prompt that shares nothing and is not `shared_later` by `admit` (a step for a prefix
        seen once); chunks that end on a snapshot point anyway leave one too (`computed`)."""
        bs = self.block_size
        points = [p for p in range(hit + bs, min(shared, prompt_len) + 1, bs)
                  if any(kind.snapshot_point(p, bs) for kind in self.kinds)]
        return points[-1:]

    def prefill_end(self, start: int, end: int, prompt_len: int, seq: SeqBlocks | None = None) -> int:
        """Where a prefill chunk meant to compute tokens [start, end) ends so that every kind can take it
        (CacheKind.prefill_end: a recurrent layer's chunk grid) and `seq` leaves its planned snapshots (its cuts,
        on that grid); `end` for attention-only models."""
        end = min(kind.prefill_end(start, end, prompt_len) for kind in self.kinds)
        return next((c for c in (seq.cuts if seq else ()) if start < c < end), end)

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
                for restore in [r for r in seq.restores if r[0] == g and len(table) == 1]:
                    self._copies.append((g, restore[1], table[0]))  # the snapshot into its new slot
                    self._held.append(restore)
                    seq.restores.remove(restore)
                    self.stats.snapshots_restored += 1
        return True

    def take_copies(self) -> list[tuple[int, int, int]]:
        """The block copies (group, from, to) planned since the last call, in order; the engine makes them at
        once: after a step's `computed` (snapshots saved) and before its forward (snapshots restored into the slots
        `grow` gave). The blocks held for them are let go."""
        copies, self._copies = self._copies, []
        for g, block in self._held:
            self.pools[g].release(block)
        self._held = []
        return copies

    def computed(self, seq: SeqBlocks, tokens: Sequence[int], num_computed: int,
                 prompt_len: int | None = None) -> None:
        """Tokens [0, num_computed) of `tokens` (the first `prompt_len` the prompt) are in the cache: register
        their new full blocks for reuse (not past the prompt where decode differs), save a snapshot where one is
        taken (a prompt chunk ending on a snapshot point), then free what a sliding window no longer reads."""
        bs = self.block_size
        if self.prefix_caching:
            reach = num_computed
            if self.decode_differs and prompt_len is not None:
                reach = min(reach, prompt_len)
            parent = seq.hashes[-1] if seq.hashes else ROOT_HASH
            for i in range(len(seq.hashes), reach // bs):
                block_tokens = tokens[i * bs : (i + 1) * bs]
                parent = block_hash(parent, block_tokens)
                seq.hashes.append(parent)
                for g, (kind, pool) in enumerate(zip(self.kinds, self.pools)):
                    if kind.holds_token_blocks and seq.tables[g][i] >= 0:
                        pool.register(seq.tables[g][i], parent, block_tokens)
            if num_computed % bs == 0 and (prompt_len is None or num_computed <= prompt_len):
                self._save_snapshot(seq, num_computed, tokens[num_computed - bs : num_computed])
        for g, (kind, pool) in enumerate(zip(self.kinds, self.pools)):
            table = seq.tables[g]
            for i in range(min(kind.first_live_block(num_computed, bs), len(table))):
                if table[i] >= 0:
                    pool.release(table[i])
                    table[i] = -1

    def _save_snapshot(self, seq: SeqBlocks, position: int, block_tokens: Sequence[int]) -> None:
        """Copy `seq`'s state slot (its chunk just ended at `position`) into a free slot registered under the
        prefix hash of its block ending there, in each group that snapshots there and has none of it yet. A
        group with no free slot keeps none (a snapshot never preempts a sequence)."""
        hash_ = seq.hashes[position // self.block_size - 1]
        for g, (kind, pool) in enumerate(zip(self.kinds, self.pools)):
            if not kind.snapshot_point(position, self.block_size) or pool.lookup(hash_, block_tokens) is not None:
                continue
            if pool.num_free == 0:
                continue
            block = pool.allocate()  # the least recently used free slot: an old snapshot is evicted
            pool.register(block, hash_, block_tokens)
            self._copies.append((g, seq.tables[g][0], block))
            self._held.append((g, block))
            self.stats.snapshots_saved += 1

    def free(self, seq: SeqBlocks) -> None:
        """Give back every block (tail first: the LRU reuses a prefix's last blocks before its first)."""
        for g, pool in enumerate(self.pools):
            for block in reversed(seq.tables[g]):
                if block >= 0:
                    pool.release(block)
            seq.tables[g] = []
        for g, block in seq.restores:  # admitted, then given back before its slot was taken
            self.pools[g].release(block)
        seq.hashes, seq.restores, seq.cuts = [], [], []

    # ------------------------------------------------------------------------------------------ reporting
    def usage(self) -> list[tuple[str, int, int]]:
        """(kind, blocks used, blocks in the pool) per group."""
        return [(kind.describe(), pool.num_used, pool.num_blocks) for kind, pool in zip(self.kinds, self.pools)]
