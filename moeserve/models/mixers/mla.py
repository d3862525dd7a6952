"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): a `TokenMixer` over a compressed latent cache.

Per token (transformers' DeepseekV3Attention, with its cache kept compressed):

    q = q_b(rms_norm(q_a(x)))  or  q_proj(x)          # [nh, nope + rope]
    c, k_pe = kv_a_proj_with_mqa(x)                    # the latent [kv_lora_rank] and one rotated key [rope] for all heads
    c = rms_norm(c);  q_pe, k_pe = rope(q_pe), rope(k_pe)   # DeepSeek's interleaved pairs unless rope_interleave=false
    cache[token] = [c, k_pe]                           # state/kinds.py LatentKV: kv_lora_rank + rope values per token
    k_nope, v = kv_b(c) per head                       # never built: the absorbed form below is the same product

Absorbed form (every token, prefill and decode): kv_b's key part W_UK [nh, nope, kv_lora] is folded into the query
(q_lat = q_nope W_UK), so a head's score over a cached token is q_lat . c + q_pe . k_pe, and its output is
(sum_t p_t c_t) W_UV^T with kv_b's value part W_UV [nh, v, kv_lora]: the per-head keys and values of the whole
context are never expanded. With the C++ ops (numerics.cpp) one op, mla_attention (csrc/mla_attention.cpp), does
it all per query row in the canonical order of csrc/attention_core.h: the same bits on every ISA and for any batch,
chunking or prefix-cache hit. The torch path (kernels=torch) puts queries in blocks of QUERY_BLOCK positions aligned
to multiples of it (rows outside the step zero-padded), each block against the cached rows up to its end (later
ones masked): a block's call shapes depend only on its positions, so the same guarantees hold on one machine.
Shapes: N tokens, nh heads, r = rope dims, R = kv_lora_rank, W = R + r (a cached row).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from moeserve.models.layers.base import ForwardBatch, Rotary, TokenMixer, not_in_gemv_layout, rms_norm
from moeserve.models.layers.linear import Linear
from moeserve.models.loader import WeightLoader
from moeserve.models.mixers.indexer import LightningIndexer, rotate
from moeserve.models.mixers.query_blocks import QUERY_BLOCK, QueryBlock, query_blocks
from moeserve.models.numerics import Numerics
from moeserve.models.registry import Architecture
from moeserve.models.spec import MlaSpec, ModelSpec
from moeserve.state.kv_cache import PagedKVCache

# (a query block, the end of the positions it sees) -> the cached rows each of its queries attends [size, end] bool
KeysKept = Callable[[QueryBlock, int], "torch.Tensor | None"]


def cached_rows(cache: torch.Tensor, table: list[int], end: int) -> torch.Tensor:
    """The rows of positions [0, end) of a sequence with block `table` in a paged cache [blocks, bs, width]."""
    bs = cache.shape[1]
    blocks = torch.tensor(table[: -(-end // bs)], dtype=torch.long, device=cache.device)
    return cache[blocks].reshape(-1, cache.shape[-1])[:end]


class MlaAttention(TokenMixer):
    cpp_op_applies = True  # the C++ mla_attention computes this layer (when the C++ ops are on)

    def __init__(self, spec: MlaSpec, num_heads: int, layer: int, q_a: Linear | None, q_a_norm: torch.Tensor | None,
                 q: Linear, kv_a: Linear, kv_a_norm: torch.Tensor, kv_b: torch.Tensor, o: Linear, rotary: Rotary,
                 eps: float, numerics: Numerics = Numerics()) -> None:
        """q_a / q_a_norm: the query's low-rank pair (None without q_lora_rank: `q` is q_proj, else q_b_proj);
        kv_b: kv_b_proj's weight [nh * (nope + v), R], split here per head into its key part and value part, laid
        out for the path that runs: mla_attention's W_UK^T [nh, R, nope] and W_UV [nh, v, R] (rows of its dots)
        with the C++ ops, else the torch path's W_UK [nh, nope, R] and W_UV^T [nh, R, v] (operands of bmm)."""
        self.spec, self.num_heads, self.layer = spec, num_heads, layer
        self.q_a, self.q_a_norm, self.q, self.kv_a, self.kv_a_norm, self.o = q_a, q_a_norm, q, kv_a, kv_a_norm, o
        per_head = kv_b.view(num_heads, spec.qk_nope_head_dim + spec.v_head_dim, spec.kv_lora_rank)
        w_uk, w_uv = per_head[:, : spec.qk_nope_head_dim], per_head[:, spec.qk_nope_head_dim :]
        self.cpp = numerics.cpp and self.cpp_op_applies
        if self.cpp:  # one copy of kv_b either way
            self.w_uk, self.w_uv = w_uk.transpose(1, 2).contiguous(), w_uv.contiguous()  # [nh, R, nope], [nh, v, R]
        else:
            self.w_uk, self.w_uv = w_uk.contiguous(), w_uv.transpose(1, 2).contiguous()  # [nh, nope, R], [nh, R, v]
        self.rotary, self.eps, self.numerics = rotary, eps, numerics

    def __call__(self, x: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        q_nope, q_pe, _ = self._project(x, batch, kv)
        cache, g = kv.latent(self.layer), kv.group_of(self.layer)
        if self.cpp:
            out = torch.ops.moeserve.mla_attention(q_nope, q_pe, cache, batch.block_tables[g], batch.rows,
                                                   batch.positions, self.w_uk, self.w_uv, self.spec.softmax_scale)
        else:
            out = self._attend(q_nope, q_pe, cache, batch.tables[g], batch)  # [N, nh, v]
        return self.o(out.reshape(x.shape[0], self.num_heads * self.spec.v_head_dim))

    def _project(self, x: torch.Tensor, batch: ForwardBatch,
                 kv: PagedKVCache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(q_nope [N, nh, nope], rotated q_pe [N, nh, rope], the query latent q_a_norm(q_a(x)) or None without
        q_lora_rank) of the tokens x [N, H]; their latent rows written to the cache."""
        s, n = self.spec, x.shape[0]
        q_resid = None
        if self.q_a is not None:
            assert self.q_a_norm is not None
            q_resid = self._norm(self.q_a(x), self.q_a_norm)
            q = self.q(q_resid)
        else:
            q = self.q(x)
        q_nope, q_pe = q.view(n, self.num_heads, s.qk_head_dim).split([s.qk_nope_head_dim, s.qk_rope_head_dim], -1)
        c, k_pe = self.kv_a(x).split([s.kv_lora_rank, s.qk_rope_head_dim], -1)
        c = self._norm(c, self.kv_a_norm)
        q_pe = self._rope(q_pe, batch.positions)
        k_pe = self._rope(k_pe.unsqueeze(1), batch.positions).squeeze(1)
        cache = kv.latent(self.layer)  # [blocks, bs, W]
        cache.view(-1, s.latent_width)[batch.slot_mappings[kv.group_of(self.layer)]] = torch.cat([c, k_pe], dim=-1)
        return q_nope, q_pe, q_resid

    def describe(self) -> str:
        """The start-up log's line: how the latent cache is attended, and why."""
        if self.cpp:
            return ("C++ mla_attention for every token, absorbed form over the latent cache: each query row alone in "
                    "one stated order (csrc/attention_core.h: the same bits on every ISA)")
        return (f"torch, absorbed form over the latent cache, queries in blocks of {QUERY_BLOCK} aligned positions "
                "(the C++ kernels are off)")

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm (fp32, cast, then scaled); batch-invariant: in fixed row blocks."""
        return self.numerics.rows(lambda t: rms_norm(t, weight, self.eps), x)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [N, heads, r] rotated at `positions` (DeepSeek's interleaved pairs unless rope_interleave is false)."""
        return rotate(x, positions, self.rotary, self.spec.interleaved_rope)

    def _attend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, tables: list[list[int]],
                batch: ForwardBatch, keep: KeysKept | None = None) -> torch.Tensor:
        """The torch path: every sequence's new tokens against its cached rows, in aligned query blocks: [N, nh, v].
        `keep(block, end)`: the rows of positions [0, end) each of the block's queries attends ([size, end] bool;
        None: every visible one)."""
        bs = cache.shape[1]
        outs = []
        for blk in query_blocks(batch, bs):
            end = blk.first + blk.size
            latent = cached_rows(cache, tables[blk.seq], end)  # positions [0, end)
            kept = None if keep is None else keep(blk, end)
            outs.append(blk.own(self._block(blk.padded(q_nope), blk.padded(q_pe), latent, blk.first, kept)))
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _block(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, first: int,
               kept: torch.Tensor | None = None) -> torch.Tensor:
        """Queries at positions [first, first + r) ([r, nh, nope], [r, nh, rope]) against the cached rows of
        positions [0, first + r) (`latent` [first + r, W]; rows past a query's position masked, and with `kept`
        [r, first + r] the rows it does not keep): [r, nh, v]."""
        s, r = self.spec, q_nope.shape[0]
        c, k_pe = latent.split([s.kv_lora_rank, s.qk_rope_head_dim], -1)  # [L, R], [L, rope]
        q_lat = torch.bmm(q_nope.transpose(0, 1), self.w_uk)  # [nh, r, R] (w_uk: [nh, nope, R] on this path)
        scores = torch.matmul(q_lat, c.t()) + torch.matmul(q_pe.transpose(0, 1), k_pe.t())  # [nh, r, L]
        if kept is None:
            q_pos = torch.arange(first, first + r, device=latent.device)[:, None]
            kept = torch.arange(latent.shape[0], device=latent.device)[None, :] <= q_pos  # [r, L]
        scores = (scores.float() * s.softmax_scale).masked_fill(~kept, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(c.dtype)
        o_lat = torch.matmul(probs, c)  # [nh, r, R]
        return torch.bmm(o_lat, self.w_uv).transpose(0, 1)  # [r, nh, v] (w_uv: [nh, R, v] on this path)

    def linears(self) -> list[Linear]:
        return [lin for lin in (self.q_a, self.q, self.kv_a, self.o) if lin is not None]

    def why_not_stacked(self) -> str | None:
        return not_in_gemv_layout(self.linears())

    def add_to_stack(self, stack: Any, kv: PagedKVCache, input_norm: torch.Tensor, post_norm: torch.Tensor) -> None:
        """__call__ for decode-only batches (csrc/decode_stack_mla.cpp): the same ops and norms (the stack runs only
        with the C++ ops, so w_uk / w_uv are mla_attention's layouts)."""
        s, cache = self.spec, kv.latent(self.layer)
        block = QUERY_BLOCK if cache.shape[1] % QUERY_BLOCK == 0 else cache.shape[1]  # as query_blocks cuts
        q_a = (None, None, None) if self.q_a is None else (*self.q_a.gemv_tensors(), self.q_a.bias)
        sizes = [self.num_heads, s.qk_nope_head_dim, s.qk_rope_head_dim, s.kv_lora_rank, s.v_head_dim,
                 kv.group_of(self.layer), self.rotary.rotary_dim, block, int(s.interleaved_rope)]
        stack.add_mla(input_norm, post_norm, *q_a, self.q_a_norm, *self.q.gemv_tensors(), self.q.bias,
                      *self.kv_a.gemv_tensors(), self.kv_a.bias, self.kv_a_norm, self.w_uk, self.w_uv,
                      *self.o.gemv_tensors(), self.o.bias, self.rotary.cos, self.rotary.sin, cache, sizes,
                      s.softmax_scale)


class DsaAttention(MlaAttention):
    """DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): MLA in which each query attends only the cached rows its
    lightning indexer chooses (models/mixers/indexer.py); the indexer's keys are cached beside the latent rows
    (PagedKVCache.index_keys). A layer without an indexer (GLM-5's shared layers) attends the rows the last layer
    with one chose in this forward (ForwardBatch.key_choices). Runs the torch absorbed form in aligned query blocks,
    with the C++ ops on too: the C++ mla_attention attends every row (no selection), so the fused decode step does
    not take this layer."""

    cpp_op_applies = False

    def __init__(self, *args: Any, indexer: LightningIndexer | None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.indexer = indexer

    def __call__(self, x: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        q_nope, q_pe, q_resid = self._project(x, batch, kv)
        g, choices = kv.group_of(self.layer), batch.key_choices
        keep: KeysKept = lambda blk, end: choices[(blk.seq, blk.first)]  # noqa: E731 - a shared layer reads them
        if self.indexer is not None:
            assert q_resid is not None  # the indexer reads the query latent: q_lora_rank is required (archs)
            keep = self._choose(x, q_resid, batch, kv, choices)
        out = self._attend(q_nope, q_pe, kv.latent(self.layer), batch.tables[g], batch, keep)
        return self.o(out.reshape(x.shape[0], self.num_heads * self.spec.v_head_dim))

    def _choose(self, x: torch.Tensor, q_resid: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache,
                choices: dict[tuple[int, int], torch.Tensor | None]) -> KeysKept:
        """Cache the tokens' indexer keys; the rows each query block attends, computed (and kept in `choices`) as
        `_attend` asks for them."""
        ix, g = self.indexer, kv.group_of(self.layer)
        assert ix is not None
        keys = kv.index_keys(self.layer)  # [blocks, bs, D]
        keys.view(-1, keys.shape[-1])[batch.slot_mappings[g]] = ix.keys(x, batch.positions)
        picks: list[torch.Tensor] = []  # the indexer's queries and weights, computed once a block sees > topk keys

        def keep(blk: QueryBlock, end: int) -> torch.Tensor | None:
            kept = None  # no query of the block sees more than topk keys: it attends them all
            if end > ix.spec.topk:
                if not picks:
                    picks.extend(ix.queries(x, q_resid, batch.positions))
                q, weights = picks
                kept = ix.chosen(blk.padded(q), blk.padded(weights),
                                 cached_rows(keys, batch.tables[g][blk.seq], end), blk.first)
            choices[(blk.seq, blk.first)] = kept
            return kept

        return keep

    def describe(self) -> str:
        ix = self.spec.indexer
        assert ix is not None
        shared = f"; {len(ix.shared)} layers reuse the choice of the layer before them" if ix.shared else ""
        return (f"DeepSeek Sparse Attention: each query attends the {ix.topk} cached rows of highest index score "
                f"({ix.n_heads} indexer heads of {ix.head_dim}; ties to the earlier position{shared}), torch "
                f"absorbed form in query blocks of {QUERY_BLOCK} aligned positions (the C++ mla_attention attends "
                "every row)")

    def linears(self) -> list[Linear]:
        return super().linears() + ([] if self.indexer is None else self.indexer.linears())

    def why_not_stacked(self) -> str | None:
        return "DeepSeek Sparse Attention's key selection runs in torch (the fused step attends every cached row)"


def build_mla(load: WeightLoader, arch: Architecture, spec: ModelSpec, L: int, rotary: Rotary,
              numerics: Numerics) -> MlaAttention:
    """Layer L's latent attention from the checkpoint (the shapes models/validate.py checked); with an indexer
    (spec.mla.indexer) its sparse form."""
    m, names, h, nh = spec.mla, arch.names, spec.hidden_size, spec.attention.num_heads
    assert m is not None

    def n(template: str) -> str:
        return template.format(L=L)

    q_a = q_a_norm = None
    if m.q_lora_rank is not None:
        q_a = load.linear(n(names.mla_q_a), m.q_lora_rank, h, m.bias)
        q_a_norm = load.tensor(n(names.mla_q_a_norm), (m.q_lora_rank,))
        q = load.linear(n(names.mla_q_b), nh * m.qk_head_dim, m.q_lora_rank)
    else:
        q = load.linear(n(names.q_proj), nh * m.qk_head_dim, h)
    kv_a = load.linear(n(names.mla_kv_a), m.latent_width, h, m.bias)
    kv_a_norm = load.tensor(n(names.mla_kv_a_norm), (m.kv_lora_rank,))
    kv_b = load.linear_weight(n(names.mla_kv_b), nh * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
    o = load.linear(n(names.o_proj), h, nh * m.v_head_dim, m.bias)
    parts = (m, nh, L, q_a, q_a_norm, q, kv_a, kv_a_norm, kv_b, o, rotary, spec.rms_norm_eps, numerics)
    if m.indexer is None:
        return MlaAttention(*parts)
    shared = L in m.indexer.shared  # GLM-5: no indexer, the choice of the layer before
    return DsaAttention(*parts, indexer=None if shared else build_indexer(load, arch, spec, L, rotary, numerics))


def build_indexer(load: WeightLoader, arch: Architecture, spec: ModelSpec, L: int, rotary: Rotary,
                  numerics: Numerics) -> LightningIndexer:
    """Layer L's lightning indexer: wq_b, wk and the LayerNorm in the compute dtype, weights_proj in fp32."""
    m, names, h = spec.mla, arch.names, spec.hidden_size
    assert m is not None and m.indexer is not None and m.q_lora_rank is not None
    ix = m.indexer

    def n(template: str) -> str:
        return template.format(L=L)

    wq_b = load.linear(n(names.indexer_wq_b), ix.n_heads * ix.head_dim, m.q_lora_rank)
    wk = load.linear(n(names.indexer_wk), ix.head_dim, h)
    k_norm = load.tensor(n(names.indexer_k_norm) + ".weight", (ix.head_dim,))
    k_norm_bias = load.tensor(n(names.indexer_k_norm) + ".bias", (ix.head_dim,))
    weights = load.tensor(n(names.indexer_weights) + ".weight", (ix.n_heads, h), torch.float32)
    return LightningIndexer(ix, m.qk_rope_head_dim, wq_b, wk, k_norm, k_norm_bias,
                            load.make_linear(weights, None, quantize=False), rotary, numerics)


def kv_per_token_line(spec: ModelSpec, itemsize: int) -> str | None:
    """The latent cache's bytes per token beside those of the same model with full per-head keys and values (None
    without MLA). The engine logs it at start-up and `moeserve plan` prints it (name "KV per token")."""
    m = spec.mla
    if m is None:
        return None
    layers, heads = spec.num_layers, spec.attention.num_heads
    index = 0 if m.indexer is None else m.indexer.head_dim  # DeepSeek Sparse Attention: the indexer's key
    shared = 0 if m.indexer is None else len(m.indexer.shared)  # GLM-5's layers without an indexer: no key
    latent = (layers * (m.latent_width + index) - shared * index) * itemsize
    full = layers * heads * (m.qk_head_dim + m.v_head_dim) * itemsize
    indexed = f" + indexer key {index}" if index else ""
    indexed += f" in {layers - shared} of them" if shared else ""
    return (f"{latent} bytes/token in the latent cache ({layers} layers x {m.latent_width + index} values: "
            f"kv_lora_rank {m.kv_lora_rank} + rope {m.qk_rope_head_dim}{indexed}); {full} bytes/token with full "
            f"per-head keys and values ({heads} heads x (key {m.qk_head_dim} + value {m.v_head_dim})): "
            f"{full / latent:.1f}x less")
