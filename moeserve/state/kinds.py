"""Kinds of per-layer sequence memory, behind one interface. Pure Python (no torch).

Layers that keep the same kind of memory form one KV group (state/kv_cache.py): one block pool, one block table
per sequence. A kind says which blocks a sequence must hold and which prefix-cache hits it can use; the block
manager (state/manager.py) does the rest the same way for every kind.

- `FullAttention`: every past token's keys and values, `block_size` tokens per block.
- `LatentKV(width)`: full attention whose cache holds one row of `width` values per token and layer instead of
  keys and values per head (multi-head latent attention: the compressed latent and the shared rotated key); blocks,
  prefix hits and reuse as for full attention.
- `IndexedLatentKV(width, index_width)`: `LatentKV` plus the key of DeepSeek Sparse Attention's lightning indexer,
  `index_width` values per token and layer on the same blocks (paged, cached and recomputed with the latent).
- `SlidingWindow(window)`: a token attends to the last `window` positions only; blocks that fall out of the
  window are freed as the sequence advances.
- `RecurrentState`: a fixed-size state per sequence (linear attention, SSM): one block per sequence whatever its
  length (its "block" is the sequence's state slot, allocated at admission, freed at finish or preemption). A state
  is only valid at the position it was left at, so its prefixes are cached as snapshots: copies of a sequence's
  state taken where a prefill chunk ends on a snapshot point (a full-block boundary on the chunk grid), kept in
  `snapshots` extra slots of the same pool under that block's prefix hash, evicted LRU like blocks; a hit of k
  blocks needs a snapshot at block k, copied into the new sequence's slot (`restore_block`). Without snapshot
  slots a model with such layers runs without prefix reuse (SequenceMemory.prefix_caching off, logged).

A kind also says how many sequences' worth of blocks its pool needs whatever the context (`fixed_blocks`), what
one block costs (`block_bytes`), which cache row a token's state goes to (`slot_of`) and where a prefill chunk may
end (`prefill_end`: a recurrent layer's chunk form is exact only on its own grid of positions).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence


class CacheKind(ABC):
    name: str = ""
    caches_prefixes: bool = True  # its full blocks can be registered and reused by other sequences
    prefill_step: int = 1  # a prefill chunk computes a multiple of this many positions (or ends the prompt)
    holds_token_blocks: bool = True  # table entry i holds the tokens of block i (registered and taken by hash)
    # tokens computed one by one after the prompt (decode) get other bits than in a prompt chunk (a recurrent
    # step vs its chunk form): no prefix hit or cached block may reach past a prompt, in any group of the model
    decode_differs: bool = False
    # a forward overwrites what a sequence holds (a recurrent state updated in place), so a forward that failed
    # part-way cannot be run again: its sequences are recomputed from their tokens (LLMEngine.step)
    written_in_place: bool = False
    # (KV heads, head dim) of the keys and values its layers cache when they differ from the model's (Gemma-4's
    # global layers); None: the model's
    heads: tuple[int, int] | None = None

    @abstractmethod
    def blocks_for(self, num_tokens: int, block_size: int) -> int:
        """Length of the block table of a sequence holding `num_tokens` tokens."""

    def first_live_block(self, next_position: int, block_size: int) -> int:
        """Blocks below this index are never read again once the sequence's next token is at `next_position`."""
        return 0

    def usable_hit(self, found: Sequence[int | None], k: int, block_size: int) -> bool:
        """Whether a prefix hit of `k` full blocks can be used, `found[i]` being the cached block of the prompt's
        i-th full block (None: not cached): every block still read after the hit must be there."""
        lo = self.first_live_block(k * block_size, block_size)
        return all(found[i] is not None for i in range(lo, k))

    def restore_block(self, found: Sequence[int | None], k: int) -> int | None:
        """The cached block to copy into the sequence's own first block on a hit of `k` full blocks (None: the
        hit's blocks are shared as they are)."""
        return None

    def snapshot_point(self, position: int, block_size: int) -> bool:
        """Whether a prefill chunk ending at `position` (a full-block boundary) leaves a state worth a copy kept
        for later prompts with this prefix (recurrent snapshots; never for kinds that share their blocks)."""
        return False

    def describe(self) -> str:
        return self.name

    def block_bytes(self, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, itemsize: int) -> int:
        """Bytes of one block in all `num_layers` layers of the group (keys and values by default, of `heads`
        when set)."""
        num_kv_heads, head_dim = self.heads or (num_kv_heads, head_dim)
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize

    def fixed_blocks(self, max_num_seqs: int, max_num_batched_tokens: int, block_size: int) -> int | None:
        """Blocks the pool needs whatever the context length (None: it takes a share of what is left)."""
        return None

    def slot_of(self, table: Sequence[int], position: int, block_size: int) -> int:
        """The cache row of the token at `position` of a sequence with block table `table`."""
        return table[position // block_size] * block_size + position % block_size

    def prefill_end(self, start: int, end: int, prompt_len: int) -> int:
        """Where a prefill chunk that would compute tokens [start, end) must end instead (default: at `end`)."""
        return end


class FullAttention(CacheKind):
    name = "full attention"

    def __init__(self, heads: tuple[int, int] | None = None) -> None:
        self.heads = heads
        if heads is not None:
            self.name = f"full attention ({heads[0]} KV heads of {heads[1]})"

    def blocks_for(self, num_tokens: int, block_size: int) -> int:
        return -(-num_tokens // block_size)


class LatentKV(FullAttention):
    """One `width`-value row per token and layer (MLA's latent + rotated key), `block_size` rows per block."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width
        self.name = f"latent attention ({width} values per token)"

    def block_bytes(self, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, itemsize: int) -> int:
        return num_layers * block_size * self.width * itemsize


class IndexedLatentKV(LatentKV):
    """LatentKV and, on the same blocks, one `index_width`-value indexer key per token and layer (DeepSeek Sparse
    Attention: the lightning indexer scores a query against every cached key to choose the latent rows it reads)."""

    def __init__(self, width: int, index_width: int) -> None:
        super().__init__(width)
        self.index_width = index_width
        self.name = f"latent attention ({width} values per token) + indexer keys ({index_width} values per token)"

    def block_bytes(self, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, itemsize: int) -> int:
        return num_layers * block_size * (self.width + self.index_width) * itemsize


class SlidingWindow(CacheKind):
    def __init__(self, window: int, heads: tuple[int, int] | None = None) -> None:
        if window < 1:
            raise ValueError(f"sliding window must be >= 1, got {window}")
        self.window, self.heads = window, heads
        self.name = f"sliding window {window}" + ("" if heads is None else f" ({heads[0]} KV heads of {heads[1]})")

    def blocks_for(self, num_tokens: int, block_size: int) -> int:
        return -(-num_tokens // block_size)

    def first_live_block(self, next_position: int, block_size: int) -> int:
        return max(0, next_position - self.window + 1) // block_size

    def max_live_blocks(self, new_tokens: int, block_size: int) -> int:
        """Blocks one sequence holds at most while computing `new_tokens` tokens in one step."""
        return -(-(self.window - 1 + new_tokens) // block_size) + 1

    def fixed_blocks(self, max_num_seqs: int, max_num_batched_tokens: int, block_size: int) -> int | None:
        # each running sequence its window plus one step's tokens, and one step's prefill beside them
        return max_num_seqs * (self.max_live_blocks(1, block_size) + 1) + -(-max_num_batched_tokens // block_size)


class RecurrentState(CacheKind):
    """One state slot per sequence per layer of the group: `conv_shape` elements in the compute dtype (a short
    convolution's last inputs) and `state_shape` elements in fp32 (the recurrent state). Prompt tokens are computed
    in chunks of `prefill_chunk` positions from 0, so a prefill chunk ends on that grid or at the prompt's end.
    `snapshots` more slots of the pool hold copies of states at snapshot points (0: no prefix caching)."""

    name = "recurrent state"
    holds_token_blocks = False  # the table is the sequence's one slot; its prefixes are snapshots
    decode_differs = True  # the recurrent step and the chunk form agree to rounding only (docs/hybrid-models.md)
    written_in_place = True  # each token advances the state in its slot

    def __init__(self, conv_shape: tuple[int, ...] = (), state_shape: tuple[int, ...] = (),
                 prefill_chunk: int = 1, snapshots: int = 0) -> None:
        self.conv_shape, self.state_shape, self.prefill_chunk = conv_shape, state_shape, prefill_chunk
        self.prefill_step = prefill_chunk
        self.snapshots = snapshots
        self.caches_prefixes = snapshots > 0

    def blocks_for(self, num_tokens: int, block_size: int) -> int:
        return 1 if num_tokens > 0 else 0

    def usable_hit(self, found: Sequence[int | None], k: int, block_size: int) -> bool:
        """A hit of k blocks resumes from the snapshot of block k (none needed for k == 0)."""
        return k == 0 or found[k - 1] is not None

    def restore_block(self, found: Sequence[int | None], k: int) -> int | None:
        return found[k - 1] if k > 0 else None

    def snapshot_point(self, position: int, block_size: int) -> bool:
        """Full-block boundaries on the chunk grid: a prompt resumed there is cut where one pass's chunks are."""
        step = math.lcm(block_size, self.prefill_chunk)
        return self.snapshots > 0 and position > 0 and position % step == 0

    def describe(self) -> str:
        return f"{self.name} (+{self.snapshots} prefix snapshots)" if self.snapshots else self.name

    def block_bytes(self, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, itemsize: int) -> int:
        return num_layers * (_numel(self.conv_shape) * itemsize + _numel(self.state_shape) * 4)

    def fixed_blocks(self, max_num_seqs: int, max_num_batched_tokens: int, block_size: int) -> int | None:
        return max_num_seqs + self.snapshots  # one slot per running sequence, whatever its length, + snapshots

    def slot_of(self, table: Sequence[int], position: int, block_size: int) -> int:
        return table[0]

    def prefill_end(self, start: int, end: int, prompt_len: int) -> int:
        """On the chunk grid or at (or past) the prompt's end; `start` (nothing this step) when the step's budget
        reaches no grid point: the chunk waits for a step with room (the engine requires max_num_batched_tokens
        >= prefill_step + max_num_seqs, so one comes), and a prompt in chunks gives the bits of one pass."""
        if end >= prompt_len or end % self.prefill_chunk == 0:
            return end
        return max(start, end - end % self.prefill_chunk)


class NgramState(RecurrentState):
    """The n-gram per-layer embedding's memory (Qwen4-Exp PLE): per sequence and PLE layer, the last inputs of its
    dilated conv (`conv_shape`, compute dtype) and the last ngram_size - 1 token ids (`state_shape`, held in fp32:
    exact below 2**24). A group of its own (a PLE layer's linear attention keeps its own state), snapshotted for
    prefix caching like the linear layers' state, on the same grid."""

    name = "n-gram state"
    decode_differs = False  # one formula for every token


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def kind_key(kind: CacheKind) -> tuple[str, int, tuple[int, int] | None]:
    """Equal for kinds whose layers can share one block table (same kind, same window, same head shape)."""
    return (type(kind).__name__, getattr(kind, "window", 0), kind.heads)
