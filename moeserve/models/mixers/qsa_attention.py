"""Qwen sparse attention (Qwen4-Exp's indexed attention layers, ModelSpec.qsa): Qwen3.5's gated attention (q/k
per-head zero-centred norms, partial rotary, output * sigmoid(gate)) over the positions the indexer selects
(models/mixers/qsa_select.py), a `TokenMixer` over one cache row per token: the token's keys, values and raw index
key side by side (a `LatentKV` group of width 2 * kv_heads * head_dim + index head_dim).

The torch path only (the C++ attention ops know no selection mask), queries in aligned blocks
(models/mixers/query_blocks.py) so a row's result depends on its position alone: chunked == unchunked, batched ==
alone, prefix hit == miss.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from moeserve.models.layer_weights import norm_weight, qkv_linear
from moeserve.models.layers.base import ForwardBatch, Rotary, TokenMixer, rms_norm_fp32_scale
from moeserve.models.layers.linear import Linear
from moeserve.models.mixers.mla import cached_rows
from moeserve.models.mixers.qsa_select import block_keys, select
from moeserve.models.mixers.query_blocks import QUERY_BLOCK, query_blocks
from moeserve.models.numerics import Numerics
from moeserve.models.spec import AttentionSpec, QsaSpec
from moeserve.state.kv_cache import PagedKVCache

if TYPE_CHECKING:
    from moeserve.models.loader import WeightLoader
    from moeserve.models.registry import Architecture
    from moeserve.models.spec import ModelSpec


def qsa_row_width(spec: ModelSpec) -> int:
    """Values a QSA layer caches per token: keys and values of every kv head, and the raw index key."""
    a, q = spec.attention, spec.qsa
    assert q is not None
    return 2 * a.num_kv_heads * a.head_dim + q.head_dim


class QsaAttention(TokenMixer):
    def __init__(self, spec: AttentionSpec, qsa: QsaSpec, layer: int, qkv: Linear, o: Linear, index: Linear,
                 norms: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], rotary: Rotary, eps: float,
                 numerics: Numerics) -> None:
        """qkv: rows [q, k, v, gate]; index: index_qk_proj (index query heads, then the raw key); norms: the (1 + w)
        fp32 weights of q_norm, k_norm, the indexer's q_layernorm and k_layernorm."""
        self.spec, self.qsa, self.layer = spec, qsa, layer
        self.qkv, self.o, self.index = qkv, o, index
        self.q_norm, self.k_norm, self.iq_norm, self.ik_norm = norms
        self.rotary, self.eps, self.numerics = rotary, eps, numerics
        q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.split = [q, kv, kv, q]
        self.scale = spec.head_dim**-0.5

    def __call__(self, x: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        s, n = self.spec, x.shape[0]
        q, k, v, gate = self.qkv(x).split_with_sizes(self.split, dim=-1)
        q = self.rotary.apply(self._norm(q.reshape(n, s.num_heads, s.head_dim), self.q_norm), batch.positions)
        k = self.rotary.apply(self._norm(k.reshape(n, s.num_kv_heads, s.head_dim), self.k_norm), batch.positions)
        iq, raw = self.index(x).split([self.qsa.num_heads * self.qsa.head_dim, self.qsa.head_dim], dim=-1)
        iq = self.rotary.apply(self._norm(iq.reshape(n, self.qsa.num_heads, self.qsa.head_dim), self.iq_norm),
                               batch.positions)
        cache = kv.latent(self.layer)  # [blocks, bs, W]
        g = kv.group_of(self.layer)
        cache.view(-1, cache.shape[-1])[batch.slot_mappings[g]] = torch.cat([k.reshape(n, -1), v, raw], dim=-1)
        out = self._attend(q, iq, cache, batch.tables[g], batch)  # [N, nh, d]
        gated = self.numerics.rows(lambda t: t[:, : t.shape[1] // 2] * torch.sigmoid(t[:, t.shape[1] // 2:]),
                                   torch.cat([out.reshape(n, -1), gate], dim=-1))
        return self.o(gated)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.numerics.rows(lambda t: rms_norm_fp32_scale(t, weight, self.eps), x)

    def _attend(self, q: torch.Tensor, iq: torch.Tensor, cache: torch.Tensor, tables: list[list[int]],
                batch: ForwardBatch) -> torch.Tensor:
        """Every sequence's new tokens against its cached rows, in aligned query blocks: [N, nh, d]."""
        outs = []
        for blk in query_blocks(batch, cache.shape[1]):
            rows = cached_rows(cache, tables[blk.seq], blk.first + blk.size)
            outs.append(blk.own(self._block(blk.padded(q), blk.padded(iq), rows, blk.first)))
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _block(self, q: torch.Tensor, iq: torch.Tensor, rows: torch.Tensor, first: int) -> torch.Tensor:
        """Queries at positions [first, first + r) against the cached rows of positions [0, first + r)."""
        s, r, end = self.spec, q.shape[0], rows.shape[0]
        kv_width = s.num_kv_heads * s.head_dim
        k, v, raw = rows.split([kv_width, kv_width, self.qsa.head_dim], dim=-1)
        positions = torch.arange(first, first + r, device=rows.device)
        keys = block_keys(raw, self.qsa.compress_ratio, self.ik_norm, self.eps, self.rotary)
        chosen = select(iq, positions, keys, self.qsa.compress_ratio, self.qsa.budget, end)  # [r, end]
        group = s.num_heads // s.num_kv_heads
        k = k.reshape(end, s.num_kv_heads, s.head_dim).repeat_interleave(group, dim=1).transpose(0, 1)
        v = v.reshape(end, s.num_kv_heads, s.head_dim).repeat_interleave(group, dim=1).transpose(0, 1)
        scores = torch.matmul(q.transpose(0, 1), k.transpose(1, 2)).float() * self.scale  # [nh, r, end]
        probs = torch.softmax(scores.masked_fill(~chosen, float("-inf")), dim=-1).to(v.dtype)
        return torch.matmul(probs, v).transpose(0, 1)  # [r, nh, d]

    def describe(self) -> str:
        return (f"Qwen sparse attention: torch, the indexer's {self.qsa.budget // self.qsa.compress_ratio} best blocks "
                f"of {self.qsa.compress_ratio} keys and the incomplete last one per query, queries in blocks of "
                f"{QUERY_BLOCK} aligned positions")

    def linears(self) -> list[Linear]:
        return [self.qkv, self.o, self.index]

    def why_not_stacked(self) -> str | None:
        return "Qwen sparse attention (the C++ attention ops know no selection mask)"

    def add_to_stack(self, stack: Any, kv: PagedKVCache, input_norm: torch.Tensor, post_norm: torch.Tensor) -> None:
        raise NotImplementedError("why_not_stacked: never stacked")


def build_qsa_attention(load: WeightLoader, arch: Architecture, spec: ModelSpec, L: int, rotary: Rotary,
                        numerics: Numerics) -> QsaAttention:
    """Layer L's sparse attention from the checkpoint (the shapes models/validate.py checked)."""
    a, qsa, names, h = spec.attention, spec.qsa, arch.names, spec.hidden_size
    assert qsa is not None
    prefix = names.indexer.format(L=L)
    norms = (norm_weight(load, names.q_norm.format(L=L), spec, (a.head_dim,)),
             norm_weight(load, names.k_norm.format(L=L), spec, (a.head_dim,)),
             norm_weight(load, prefix + ".q_layernorm.weight", spec, (qsa.head_dim,)),
             norm_weight(load, prefix + ".k_layernorm.weight", spec, (qsa.head_dim,)))
    index = load.linear(prefix + ".index_qk_proj", (qsa.num_heads + 1) * qsa.head_dim, h)
    return QsaAttention(a, qsa, L, qkv_linear(load, names, a, L, h),
                        load.linear(names.o_proj.format(L=L), h, a.num_heads * a.head_dim, a.o_bias), index, norms,
                        rotary, spec.rms_norm_eps, numerics)
