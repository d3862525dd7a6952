"""Aligned query blocks: how the batch-invariant attentions (mixers.attention.Attention's torch path, mla.MlaAttention) cut a
step's new tokens so that a row's result depends only on its position.

Each sequence's new tokens are covered by blocks of QUERY_BLOCK positions aligned to multiples of it; a block's
rows outside the step are zero-padded and each block attends the cached keys up to its end (later ones masked).
The call shapes are then a function of the block's positions alone, never of how the sequence was chunked,
batched or taken from the prefix cache.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from moeserve.models.layers.base import ForwardBatch

QUERY_BLOCK = 16  # query positions per call of the batch-invariant torch attention (Attention._aligned_blocks)


@dataclass(frozen=True)
class QueryBlock:
    """QUERY_BLOCK positions [first, first + size) of sequence `seq` of a batch, aligned to a multiple of `size`;
    the step computes its positions [lo, hi), rows `rows` of the flattened batch."""

    seq: int
    first: int
    size: int
    lo: int
    hi: int
    rows: slice

    def padded(self, x: torch.Tensor) -> torch.Tensor:
        """This block's rows of x [N, ...] at their positions in a zero tensor [size, ...]."""
        out = x.new_zeros(self.size, *x.shape[1:])
        out[self.lo - self.first : self.hi - self.first] = x[self.rows]
        return out

    def own(self, out: torch.Tensor) -> torch.Tensor:
        """The rows of a block's result [size, ...] that the step computes."""
        return out[self.lo - self.first : self.hi - self.first]


def query_blocks(batch: ForwardBatch, block_size: int) -> Iterator[QueryBlock]:
    """The aligned query blocks of a batch-invariant attention, sequence by sequence, in the batch's row order (a
    block's call shapes depend only on its positions: see Attention._aligned_blocks)."""
    r = QUERY_BLOCK if block_size % QUERY_BLOCK == 0 else block_size
    off = 0
    for b, (start, num) in enumerate(zip(batch.starts, batch.num_new)):
        end = start + num
        for a in range(start - start % r, end, r):
            lo, hi = max(a, start), min(a + r, end)
            yield QueryBlock(b, a, r, lo, hi, slice(off + lo - start, off + hi - start))
        off += num
