"""DeepSeek-V4's attention over one query block (ModelSpec.compressed), as transformers' DeepseekV4Attention computes
it: the queries of positions [first, first + r) of one sequence against

- the shared key=value rows of the positions in each query's sliding window (p - window < j <= p), and
- the compressed entries (models/mixers/compressor.py) each query sees (entry w once its window closed:
  w < (p + 1) // ratio); in an indexed layer only the index_topk of them its lightning indexer scores highest
  (`choose_entries`: equal scores, the earlier entry first, so the choice is the same in any chunking or batch:
  transformers' torch.topk picks either of two equal scores);

with a learned sink per head in the softmax; the output's rotary part rotated back, then the grouped low-rank
output projection (`grouped_output`). Pure functions of the block's tensors (compressed_mixer.py runs them).
"""

from __future__ import annotations

import torch

from moeserve.models.mixers.compressor import rope_tail


def index_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The lightning indexer's scores [r, T] (fp32) of queries q [r, nI, Di] (rotated) over the indexer's entries
    keys [T, Di], with per-head weights [r, nI] (weights_proj(x), scaled by nI**-0.5 by the caller):
    sum_h w_h relu(q_h . k) / sqrt(Di)."""
    scores = torch.relu(torch.matmul(q.float(), keys.float().t())) * head_dim**-0.5  # [r, nI, T]
    return (scores * weights.float().unsqueeze(-1)).sum(dim=1)


def visible_entries(positions: torch.Tensor, count: int, ratio: int) -> torch.Tensor:
    """[r, count] bool: entry w is visible to the query at position p once its window closed (w < (p + 1) // ratio)."""
    return torch.arange(count, device=positions.device)[None, :] < ((positions + 1) // ratio)[:, None]


def choose_entries(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """[r, T] bool: each query's k visible entries of highest score (all of them when it sees k or fewer); equal
    scores: the earlier entry first (a stable sort)."""
    ranked = scores.masked_fill(~visible, float("-inf"))
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[:, :k]
    kept = torch.zeros_like(visible).scatter_(1, order, True)
    return kept & visible


def attend(q: torch.Tensor, rows: torch.Tensor, entries: torch.Tensor, positions: torch.Tensor, window: int,
           kept: torch.Tensor, sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """Queries q [r, H, D] at `positions` over the key=value rows of positions [0, L) (`rows` [L, D]) within their
    window and the `kept` [r, T] entries [T, D]: [r, H, D], as transformers' eager attention with sinks (the logits
    in q's dtype, the sink column fp32, softmax in fp32 after subtracting the row's max)."""
    length = rows.shape[0]
    j = torch.arange(length, device=q.device)[None, :]
    in_window = (j <= positions[:, None]) & (j > positions[:, None] - window)  # [r, L]
    allowed = torch.cat([in_window, kept], dim=-1)  # [r, L + T]
    keys = torch.cat([rows, entries], dim=0)  # [L + T, D]: key and value alike
    logits = torch.matmul(q.transpose(0, 1), keys.t()) * scale  # [H, r, L + T]
    mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, float("-inf"))
    logits = logits + mask
    sink = sinks.reshape(-1, 1, 1).expand(-1, logits.shape[1], 1)
    combined = torch.cat([logits, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1].to(keys.dtype)
    return torch.matmul(probs, keys).transpose(0, 1)  # [r, H, D]


def grouped_output(out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, wo_a: torch.Tensor,
                   groups: int) -> torch.Tensor:
    """The attention output [r, H, D] rotated back at the queries' positions (cos, sin [r, rot/2] in its dtype),
    its heads in `groups` groups each projected by its block of wo_a [groups * R, H * D / groups]: [r, groups * R]
    (wo_b then projects it to the hidden size)."""
    r = out.shape[0]
    out = rope_tail(out, cos.unsqueeze(1), -sin.unsqueeze(1))
    grouped = out.reshape(r, groups, -1).transpose(0, 1)  # [G, r, HD/G]
    w = wo_a.view(groups, -1, grouped.shape[-1]).transpose(1, 2)  # [G, HD/G, R]
    return torch.bmm(grouped, w).transpose(0, 1).reshape(r, -1)
