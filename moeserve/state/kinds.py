"""Kinds of per-layer sequence memory, behind one interface. Pure Python (no torch).

Layers that keep the same kind of memory form one KV group (state/kv_cache.py): one block pool, one block table
per sequence. A kind says which blocks a sequence must hold and which prefix-cache hits it can use; the block
manager (state/manager.py) does the rest the same way for every kind.

- `FullAttention`: every past token's keys and values, `block_size` tokens per block (also the kind of a
  compressed MLA latent: per-token rows of another width, held the same way).
- `SlidingWindow(window)`: a token attends to the last `window` positions only; blocks that fall out of the
  window are freed as the sequence advances.
- `RecurrentState`: a fixed-size state per sequence (linear attention, SSM): one block per sequence whatever its
  length; its prefixes are not cached (a state is only valid at the position it was left at).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence


class CacheKind(ABC):
    name: str = ""
    caches_prefixes: bool = True  # its full blocks can be registered and reused by other sequences

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

    def describe(self) -> str:
        return self.name


class FullAttention(CacheKind):
    name = "full attention"

    def blocks_for(self, num_tokens: int, block_size: int) -> int:
        return -(-num_tokens // block_size)


class SlidingWindow(CacheKind):
    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError(f"sliding window must be >= 1, got {window}")
        self.window = window
        self.name = f"sliding window {window}"

    def blocks_for(self, num_tokens: int, block_size: int) -> int:
        return -(-num_tokens // block_size)

    def first_live_block(self, next_position: int, block_size: int) -> int:
        return max(0, next_position - self.window + 1) // block_size

    def max_live_blocks(self, new_tokens: int, block_size: int) -> int:
        """Blocks one sequence holds at most while computing `new_tokens` tokens in one step."""
        return -(-(self.window - 1 + new_tokens) // block_size) + 1


class RecurrentState(CacheKind):
    name = "recurrent state"
    caches_prefixes = False

    def blocks_for(self, num_tokens: int, block_size: int) -> int:
        return 1 if num_tokens > 0 else 0

    def usable_hit(self, found: Sequence[int | None], k: int, block_size: int) -> bool:
        return k == 0


def kind_key(kind: CacheKind) -> tuple[str, int]:
    """Equal for kinds whose layers can share one block table (same kind, same window)."""
    return (type(kind).__name__, getattr(kind, "window", 0))
