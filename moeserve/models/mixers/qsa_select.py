"""Qwen sparse attention's key selection (Qwen4-Exp's indexed attention layers, ModelSpec.qsa), as transformers'
Qwen4ExpTextQSAIndexer selects, with ties broken by a fixed rule.

Per token the indexer projects the layer's input to `num_heads` query heads and one raw index key (index_qk_proj),
the queries RMS-normed (zero-centred) and rotated at the token's position; the raw keys are cached per position.
The cached keys form blocks of `compress_ratio` consecutive positions from 0; a complete block's key is the mean of
its raw keys (fp32, cast back), normed and rotated at the block's first position. The query at position p scores
each block complete at p (all of its positions <= p): the sum over heads of relu(q . k) / sqrt(head_dim) in fp32,
and attends the positions of its `budget // compress_ratio` best blocks and every position of its last, incomplete
block (causal: up to p itself).

Ties (equal scores, e.g. several blocks at 0 after the relu) are broken by block position, earlier first: a stable
descending sort. transformers' topk leaves that choice to the kernel, so its pick among tied blocks can differ
between a whole forward and steps through its cache; this rule makes a query's selection a function of its own
scores only. Each score is one fp32 dot product reduced over head_dim alone (an element-wise product summed on the
last dim, never a matmul whose blocking follows the batch), so it has the same bits whatever else is in the batch:
chunked == unchunked, batched == alone.
"""

from __future__ import annotations

import math

import torch

from moeserve.models.layers.base import Rotary, rms_norm_fp32_scale


def block_keys(raw_keys: torch.Tensor, ratio: int, k_norm: torch.Tensor, eps: float, rotary: Rotary) -> torch.Tensor:
    """The keys [blocks, d] of every complete block of one sequence's cached raw keys [T, d]."""
    blocks = raw_keys.shape[0] // ratio
    pooled = raw_keys[: blocks * ratio].view(blocks, ratio, -1).float().mean(dim=1).to(raw_keys.dtype)
    normed = rms_norm_fp32_scale(pooled, k_norm, eps)
    starts = torch.arange(blocks, dtype=torch.long) * ratio
    return rotary.apply(normed.unsqueeze(1), starts).squeeze(1)


def select(q: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, ratio: int, budget: int,
           context: int) -> torch.Tensor:
    """The positions each query attends, as a mask [n, context] (bool): q [n, heads, d] the normed, rotated queries
    at `positions` [n] of one sequence, `keys` [blocks, d] its complete blocks' keys (`block_keys`)."""
    n, _heads, d = q.shape
    scores = (q.float().unsqueeze(2) * keys.float().unsqueeze(0).unsqueeze(0)).sum(-1)  # [n, heads, blocks]
    scores = torch.relu(scores).sum(dim=1) / math.sqrt(d)  # [n, blocks]
    complete = (positions + 1) // ratio  # blocks complete at each query's position
    block_ids = torch.arange(keys.shape[0])
    scores = scores.masked_fill(block_ids.unsqueeze(0) >= complete.unsqueeze(1), -math.inf)
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices  # ties: the earlier block first
    keep = torch.arange(keys.shape[0]).unsqueeze(0) < torch.clamp(complete, max=budget // ratio).unsqueeze(1)
    chosen = torch.zeros(n, keys.shape[0], dtype=torch.bool).scatter(1, order, keep)
    mask = chosen.repeat_interleave(ratio, dim=1)
    mask = torch.cat([mask, torch.zeros(n, context - mask.shape[1], dtype=torch.bool)], dim=1)
    at = torch.arange(context).unsqueeze(0)
    tail = (at >= (complete * ratio).unsqueeze(1)) & (at <= positions.unsqueeze(1))
    return mask | tail
