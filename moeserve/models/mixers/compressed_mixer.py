"""DeepSeek-V4's attention as a `TokenMixer` (ModelSpec.compressed), torch only. Per token and layer it writes one
row to its layer's paged cache (state/kinds.py LatentKV, `row_width`): the rotated key=value row [D], and in a
layer with a ratio the compressor's kv and gate projections, and the indexer's where it has one. A query block
(aligned positions, models/mixers/query_blocks.py) reads its sequence's rows up to the block's end, pools the
entries of every window closed by then (models/mixers/compressor.py: each entry a function of its windows' rows),
lets the indexer choose, and attends (models/mixers/compressed_attention.py). Every call shape is a function of the
block's positions: chunked, batched and offloaded runs give the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moeserve.models.layers.base import ForwardBatch, TokenMixer, rms_norm_fp32_scale
from moeserve.models.layers.linear import Linear
from moeserve.models.layers.mhc import unweighted_rms_norm
from moeserve.models.loader import WeightLoader
from moeserve.models.mixers.compressed_attention import (
    attend,
    choose_entries,
    grouped_output,
    index_scores,
    visible_entries,
)
from moeserve.models.mixers.compressor import Compressor, RopeTable, rope_tail
from moeserve.models.mixers.mla import cached_rows
from moeserve.models.mixers.query_blocks import query_blocks
from moeserve.models.numerics import Numerics
from moeserve.models.registry import Architecture
from moeserve.models.spec import ModelSpec
from moeserve.state.kv_cache import PagedKVCache


@dataclass(frozen=True)
class Ropes:
    """The sliding-window layers' rotary table and the compressed layers' (entries, their queries, the indexer)."""

    main: RopeTable
    compress: RopeTable


def row_width(spec: ModelSpec, L: int) -> int:
    """Values per token of layer L's cache row: its key=value row, the compressor's kv and gate projections (two
    series each where windows overlap), the indexer's (two series of index_head_dim each)."""
    ca, d = spec.compressed, spec.attention.head_dim
    assert ca is not None
    series = 2 if ca.indexed[L] else 1
    width = d + (2 * series * d if ca.ratios[L] else 0)
    return width + (4 * ca.index_head_dim if ca.ratios[L] and ca.indexed[L] else 0)


@dataclass
class Indexer:
    compressor: Compressor
    wq_b: Linear
    weights: Linear
    heads: int
    head_dim: int
    topk: int


class CompressedAttention(TokenMixer):
    def __init__(self, spec: ModelSpec, layer: int, parts: dict[str, Linear], norms: tuple[torch.Tensor, torch.Tensor],
                 sinks: torch.Tensor, compressor: Compressor | None, projections: tuple[Linear, Linear] | None,
                 indexer: Indexer | None, index_projections: tuple[Linear, Linear] | None, ropes: Ropes,
                 numerics: Numerics) -> None:
        ca, a = spec.compressed, spec.attention
        assert ca is not None
        self.layer, self.heads, self.d, self.window, self.groups = layer, a.num_heads, a.head_dim, ca.window, ca.o_groups
        self.ratio = ca.ratios[layer]
        self.parts, (self.q_norm, self.kv_norm), self.sinks = parts, norms, sinks
        self.compressor, self.projections, self.indexer, self.index_projections = (compressor, projections, indexer,
                                                                                  index_projections)
        self.rope = ropes.compress if self.ratio else ropes.main
        self.compress_rope, self.eps, self.numerics = ropes.compress, spec.rms_norm_eps, numerics

    def describe(self) -> str:
        return ("torch: per aligned query block, the sliding window and the compressed entries (pooled from the cached "
                "rows) the indexer chooses, with sinks")

    def linears(self) -> list[Linear]:
        extra = [lin for pair in (self.projections, self.index_projections) if pair is not None for lin in pair]
        index = [self.indexer.wq_b, self.indexer.weights] if self.indexer is not None else []
        return [*self.parts.values(), *extra, *index]

    def why_not_stacked(self) -> str | None:
        return "DeepSeek-V4's compressed attention (no C++ op)"

    def add_to_stack(self, stack: Any, kv: PagedKVCache, input_norm: torch.Tensor, post_norm: torch.Tensor) -> None:
        raise NotImplementedError("why_not_stacked: never stacked")

    def __call__(self, x: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        n, p = x.shape[0], self.parts
        cos, sin = self.rope.at(batch.positions, x.dtype)
        q_resid = rms_norm_fp32_scale(p["wq_a"](x), self.q_norm, self.eps)
        q = unweighted_rms_norm(p["wq_b"](q_resid).view(n, self.heads, self.d), self.eps)
        q = rope_tail(q, cos.unsqueeze(1), sin.unsqueeze(1))
        row = [rope_tail(rms_norm_fp32_scale(p["wkv"](x), self.kv_norm, self.eps), cos, sin)]
        for pair in (self.projections, self.index_projections):
            if pair is not None:
                row += [pair[0](x), pair[1](x)]
        cache, g = kv.latent(self.layer), kv.group_of(self.layer)
        cache.view(-1, cache.shape[-1])[batch.slot_mappings[g]] = torch.cat(row, dim=-1)
        outs = []
        for blk in query_blocks(batch, cache.shape[1]):
            rows = cached_rows(cache, batch.tables[g][blk.seq], blk.first + blk.size)
            positions = torch.arange(blk.first, blk.first + blk.size, device=x.device)
            out = self._block(blk.padded(q), blk.padded(q_resid), blk.padded(x), rows, positions)
            outs.append(blk.own(out))
        out = torch.cat(outs) if len(outs) > 1 else outs[0]
        return p["wo_b"](grouped_output(out, cos, sin, p["wo_a"].weight, self.groups))

    def _block(self, q: torch.Tensor, q_resid: torch.Tensor, x: torch.Tensor, rows: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        d, r = self.d, self.ratio
        entries, kept = rows[:0, :d], torch.zeros(q.shape[0], 0, dtype=torch.bool, device=q.device)
        if self.compressor is not None:
            n = rows.shape[0] // r
            width = (rows.shape[1] - d - (4 * self.indexer.head_dim if self.indexer else 0)) // 2
            entries = self.compressor.entries(rows[: n * r, d: d + width], rows[: n * r, d + width: d + 2 * width], 0)
            kept = visible_entries(positions, n, r)
            if self.indexer is not None:
                kept = self._choose(rows[: n * r, d + 2 * width:], q_resid, x, positions, kept)
        return attend(q, rows[:, :d], entries, positions, self.window, kept, self.sinks, d**-0.5)

    def _choose(self, index_rows: torch.Tensor, q_resid: torch.Tensor, x: torch.Tensor, positions: torch.Tensor,
                visible: torch.Tensor) -> torch.Tensor:
        ix = self.indexer
        assert ix is not None
        half = index_rows.shape[1] // 2
        keys = ix.compressor.entries(index_rows[:, :half], index_rows[:, half:], 0)
        cos, sin = self.compress_rope.at(positions, q_resid.dtype)
        qi = rope_tail(ix.wq_b(q_resid).view(-1, ix.heads, ix.head_dim), cos.unsqueeze(1), sin.unsqueeze(1))
        scores = index_scores(qi, keys, ix.weights(x).float() * ix.heads**-0.5, ix.head_dim)
        return choose_entries(scores, visible, ix.topk)


def build_compressed_attention(load: WeightLoader, arch: Architecture, spec: ModelSpec, L: int, ropes: Ropes,
                               numerics: Numerics) -> CompressedAttention:
    """Layer L's attention from the checkpoint (validate._compressed_attention_tensors lists what it reads)."""
    ca, a, h = spec.compressed, spec.attention, spec.hidden_size
    assert ca is not None
    prefix, f32 = arch.names.compressed_attn.format(L=L), torch.float32
    hd = a.num_heads * a.head_dim
    parts = {"wq_a": load.linear(prefix + ".wq_a", ca.q_lora_rank, h), "wq_b": load.linear(prefix + ".wq_b", hd,
                                                                                             ca.q_lora_rank),
             "wkv": load.linear(prefix + ".wkv", a.head_dim, h),
             "wo_a": load.linear(prefix + ".wo_a", ca.o_groups * ca.o_lora_rank, hd // ca.o_groups, quantize=False),
             "wo_b": load.linear(prefix + ".wo_b", h, ca.o_groups * ca.o_lora_rank)}
    norms = (load.tensor(prefix + ".q_norm.weight", (ca.q_lora_rank,), f32),
             load.tensor(prefix + ".norm.weight", (a.head_dim,), f32))
    sinks = load.tensor(prefix + ".attn_sink", (a.num_heads,), f32)
    ratio, indexed = ca.ratios[L], ca.indexed[L]
    compressor = projections = indexer = index_projections = None
    if ratio:
        compressor, projections = _compressor(load, spec, prefix + ".compressor", ratio, a.head_dim, indexed, ropes)
    if ratio and indexed:
        inner, index_projections = _compressor(load, spec, prefix + ".indexer.compressor", ratio, ca.index_head_dim,
                                               True, ropes)
        indexer = Indexer(inner, load.linear(prefix + ".indexer.wq_b", ca.index_n_heads * ca.index_head_dim,
                                             ca.q_lora_rank),
                          load.linear(prefix + ".indexer.weights_proj", ca.index_n_heads, h, quantize=False),
                          ca.index_n_heads, ca.index_head_dim, ca.index_topk)
    return CompressedAttention(spec, L, parts, norms, sinks, compressor, projections, indexer, index_projections,
                               ropes, numerics)


def _compressor(load: WeightLoader, spec: ModelSpec, prefix: str, ratio: int, width: int, overlap: bool,
                ropes: Ropes) -> tuple[Compressor, tuple[Linear, Linear]]:
    series, h = 2 if overlap else 1, spec.hidden_size
    ape = load.tensor(prefix + ".ape", (ratio, series * width), torch.float32)
    norm = load.tensor(prefix + ".norm.weight", (width,), torch.float32)
    pair = (load.linear(prefix + ".wkv", series * width, h, quantize=False),
            load.linear(prefix + ".wgate", series * width, h, quantize=False))
    return Compressor(ape, norm, ratio, width, overlap, ropes.compress, spec.rms_norm_eps), pair
