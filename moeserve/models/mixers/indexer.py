"""DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2, GLM-5): which cached keys each query attends.

Per token (transformers' DeepseekV32Indexer / GlmMoeDsaIndexer):

    k = rope(layer_norm(wk(x)))                  # [D]: cached beside the latent (state/kinds.py IndexedLatentKV)
    q = rope(wq_b(q_resid))                      # [H, D]; q_resid = q_a_layernorm(q_a_proj(x)), MLA's query latent
    w = weights_proj(x in fp32) * H**-0.5        # [H] fp32
    score(key t) = sum_h w_h relu(q_h . k_t * D**-0.5)   # fp32

Rotary turns the first qk_rope_head_dim values of q and k with the model's tables (DeepSeek's interleaved pairs for
GLM-5, half-split for DeepSeek-V3.2). A query attends the `topk` visible keys of highest score (every visible key
while it sees no more than topk).

**Ties.** Scores tie exactly (all heads' dot products negative: 0 after the ReLU), and torch.topk breaks ties by
no stated rule: transformers' reference picks different keys for one query in one 12-token pass and in an 8-token
prefill + decode. Here the order is fixed: higher score first, then the earlier position (`top_keys`; Qwen sparse
attention's choice, qsa_select.py, has the same rule). Scores are
computed per aligned query block (models/mixers/query_blocks.py) against the keys up to the block's end, so a
query's scores, and with them its keys, depend only on its position and the sequence's tokens: chunked == one
pass, batched == alone, prefix hit == miss, bit for bit.
Shapes: N tokens, H indexer heads, D index_head_dim, r query rows of a block, L keys it sees.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeserve.models.layers.base import Rotary
from moeserve.models.layers.linear import Linear
from moeserve.models.numerics import Numerics
from moeserve.models.spec import IndexerSpec

K_NORM_EPS = 1e-6  # the indexer's LayerNorm (transformers: nn.LayerNorm(index_head_dim, eps=1e-6))


def rotate(x: torch.Tensor, positions: torch.Tensor, rotary: Rotary, interleaved: bool) -> torch.Tensor:
    """x [N, heads, r] rotated at `positions`: DeepSeek's interleaved pairs (x0, x1), (x2, x3)... give the rotated
    evens then the rotated odds (transformers' apply_rotary_pos_emb_interleave), else half-split."""
    if not interleaved:
        return rotary.apply(x, positions)
    half = x.shape[-1] // 2
    cos = rotary.cos[positions, :half].unsqueeze(1)
    sin = rotary.sin[positions, :half].unsqueeze(1)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)


def top_keys(scores: torch.Tensor, first: int, k: int) -> torch.Tensor:
    """Of queries at positions [first, first + r) with index scores [r, L] over keys at positions [0, L): [r, L] bool,
    True at the `k` visible keys (position <= the query's) of highest score; equal scores: the earlier position first.
    A query that sees k keys or fewer keeps them all."""
    r, length = scores.shape
    q_pos = torch.arange(first, first + r, device=scores.device)[:, None]
    visible = torch.arange(length, device=scores.device)[None, :] <= q_pos
    ranked = scores.masked_fill(~visible, float("-inf"))
    # a stable sort keeps equal scores in position order: the earlier position wins a tie (as qsa_select.select)
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[:, :k]
    return torch.zeros_like(visible).scatter_(-1, order, True) & visible


class LightningIndexer:
    def __init__(self, spec: IndexerSpec, rope_dim: int, wq_b: Linear, wk: Linear, k_norm: torch.Tensor,
                 k_norm_bias: torch.Tensor, weights_proj: Linear, rotary: Rotary, numerics: Numerics) -> None:
        """wq_b: [H * D, q_lora_rank]; wk: [D, hidden]; k_norm(_bias): the LayerNorm's [D]; weights_proj: [H, hidden]
        in fp32 (transformers keeps it so)."""
        self.spec, self.rope_dim = spec, rope_dim
        self.wq_b, self.wk, self.k_norm, self.k_norm_bias, self.weights_proj = wq_b, wk, k_norm, k_norm_bias, weights_proj
        self.rotary, self.numerics = rotary, numerics
        self.scale = spec.head_dim**-0.5

    def keys(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The keys [N, D] of the tokens x [N, hidden] (normed hidden states) at `positions`: what the cache keeps."""
        d = self.spec.head_dim
        k = self.numerics.rows(lambda t: F.layer_norm(self.wk(t), (d,), self.k_norm, self.k_norm_bias, K_NORM_EPS), x)
        return self._rope(k.unsqueeze(1), positions).squeeze(1)

    def queries(self, x: torch.Tensor, q_resid: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor,
                                                                                                  torch.Tensor]:
        """(queries [N, H, D] in the compute dtype, head weights [N, H] fp32) of the tokens x with MLA's query
        latent q_resid [N, q_lora_rank]."""
        s = self.spec
        q = self._rope(self.wq_b(q_resid).view(x.shape[0], s.n_heads, s.head_dim), positions)
        weights = self.weights_proj(x.float()) * s.n_heads**-0.5
        return q, weights

    def chosen(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, first: int) -> torch.Tensor:
        """Of one query block (q [r, H, D], weights [r, H] at positions [first, first + r)) over the cached keys
        [L, D] of positions [0, L): the keys each query attends, [r, L] bool (top_keys of the index scores)."""
        scores = torch.relu(torch.matmul(q.float(), keys.float().t()) * self.scale)  # [r, H, L]
        index = torch.matmul(weights.unsqueeze(1), scores).squeeze(1)  # [r, L]: sum over heads of w_h * score_h
        return top_keys(index, first, self.spec.topk)

    def linears(self) -> list[Linear]:
        return [self.wq_b, self.wk, self.weights_proj]

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [N, heads, D] with its first rope_dim values rotated (the rest pass)."""
        rot, rest = x.split([self.rope_dim, x.shape[-1] - self.rope_dim], -1)
        return torch.cat([rotate(rot, positions, self.rotary, self.spec.interleaved_rope), rest], dim=-1)
