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

from typing import Any

import torch

from moeserve.models.layers.base import ForwardBatch, Rotary, TokenMixer, not_in_gemv_layout, rms_norm
from moeserve.models.layers.linear import Linear
from moeserve.models.loader import WeightLoader
from moeserve.models.mixers.query_blocks import QUERY_BLOCK, query_blocks
from moeserve.models.numerics import Numerics
from moeserve.models.registry import Architecture
from moeserve.models.spec import MlaSpec, ModelSpec
from moeserve.state.kv_cache import PagedKVCache


class MlaAttention(TokenMixer):
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
        if numerics.cpp:  # one copy of kv_b either way
            self.w_uk, self.w_uv = w_uk.transpose(1, 2).contiguous(), w_uv.contiguous()  # [nh, R, nope], [nh, v, R]
        else:
            self.w_uk, self.w_uv = w_uk.contiguous(), w_uv.transpose(1, 2).contiguous()  # [nh, nope, R], [nh, R, v]
        self.rotary, self.eps, self.numerics = rotary, eps, numerics

    def __call__(self, x: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        s, n = self.spec, x.shape[0]
        if self.q_a is not None:
            assert self.q_a_norm is not None
            q = self.q(self._norm(self.q_a(x), self.q_a_norm))
        else:
            q = self.q(x)
        q_nope, q_pe = q.view(n, self.num_heads, s.qk_head_dim).split([s.qk_nope_head_dim, s.qk_rope_head_dim], -1)
        c, k_pe = self.kv_a(x).split([s.kv_lora_rank, s.qk_rope_head_dim], -1)
        c = self._norm(c, self.kv_a_norm)
        q_pe = self._rope(q_pe, batch.positions)
        k_pe = self._rope(k_pe.unsqueeze(1), batch.positions).squeeze(1)
        cache = kv.latent(self.layer)  # [blocks, bs, W]
        g = kv.group_of(self.layer)
        cache.view(-1, s.latent_width)[batch.slot_mappings[g]] = torch.cat([c, k_pe], dim=-1)
        if self.numerics.cpp:
            out = torch.ops.moeserve.mla_attention(q_nope, q_pe, cache, batch.block_tables[g], batch.rows,
                                                   batch.positions, self.w_uk, self.w_uv, s.softmax_scale)
        else:
            out = self._attend(q_nope, q_pe, cache, batch.tables[g], batch)  # [N, nh, v]
        return self.o(out.reshape(n, self.num_heads * s.v_head_dim))

    def describe(self) -> str:
        """The start-up log's line: how the latent cache is attended, and why."""
        if self.numerics.cpp:
            return ("C++ mla_attention for every token, absorbed form over the latent cache: each query row alone in "
                    "one stated order (csrc/attention_core.h: the same bits on every ISA)")
        return (f"torch, absorbed form over the latent cache, queries in blocks of {QUERY_BLOCK} aligned positions "
                "(the C++ kernels are off)")

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm (fp32, cast, then scaled); batch-invariant: in fixed row blocks."""
        return self.numerics.rows(lambda t: rms_norm(t, weight, self.eps), x)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [N, heads, r] rotated at `positions`: DeepSeek's interleaved pairs (x0, x1), (x2, x3)... give the
        rotated evens then the rotated odds (transformers' apply_rotary_pos_emb_interleave), else half-split."""
        if not self.spec.interleaved_rope:
            return self.rotary.apply(x, positions)
        half = x.shape[-1] // 2
        cos = self.rotary.cos[positions, :half].unsqueeze(1)
        sin = self.rotary.sin[positions, :half].unsqueeze(1)
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)

    def _attend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, tables: list[list[int]],
                batch: ForwardBatch) -> torch.Tensor:
        """The torch path: every sequence's new tokens against its cached rows, in aligned query blocks: [N, nh, v]."""
        bs = cache.shape[1]
        outs = []
        for blk in query_blocks(batch, bs):
            end = blk.first + blk.size
            blocks = torch.tensor(tables[blk.seq][: -(-end // bs)], dtype=torch.long, device=cache.device)
            latent = cache[blocks].reshape(-1, cache.shape[-1])[:end]  # positions [0, end)
            outs.append(blk.own(self._block(blk.padded(q_nope), blk.padded(q_pe), latent, blk.first)))
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _block(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, first: int) -> torch.Tensor:
        """Queries at positions [first, first + r) ([r, nh, nope], [r, nh, rope]) against the cached rows of
        positions [0, first + r) (`latent` [first + r, W]; rows past a query's position masked): [r, nh, v]."""
        s, r = self.spec, q_nope.shape[0]
        c, k_pe = latent.split([s.kv_lora_rank, s.qk_rope_head_dim], -1)  # [L, R], [L, rope]
        q_lat = torch.bmm(q_nope.transpose(0, 1), self.w_uk)  # [nh, r, R] (w_uk: [nh, nope, R] on this path)
        scores = torch.matmul(q_lat, c.t()) + torch.matmul(q_pe.transpose(0, 1), k_pe.t())  # [nh, r, L]
        q_pos = torch.arange(first, first + r, device=latent.device)[:, None]
        visible = torch.arange(latent.shape[0], device=latent.device)[None, :] <= q_pos  # [r, L]
        scores = (scores.float() * s.softmax_scale).masked_fill(~visible, float("-inf"))
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


def build_mla(load: WeightLoader, arch: Architecture, spec: ModelSpec, L: int, rotary: Rotary,
              numerics: Numerics) -> MlaAttention:
    """Layer L's latent attention from the checkpoint (the shapes models/validate.py checked)."""
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
    return MlaAttention(m, nh, L, q_a, q_a_norm, q, kv_a, kv_a_norm, kv_b, o, rotary, spec.rms_norm_eps, numerics)


def kv_per_token_line(spec: ModelSpec, itemsize: int) -> str | None:
    """The latent cache's bytes per token beside those of the same model with full per-head keys and values (None
    without MLA). The engine logs it at start-up and `moeserve plan` prints it (name "KV per token")."""
    m = spec.mla
    if m is None:
        return None
    layers, heads = spec.num_layers, spec.attention.num_heads
    latent = layers * m.latent_width * itemsize
    full = layers * heads * (m.qk_head_dim + m.v_head_dim) * itemsize
    return (f"{latent} bytes/token in the latent cache ({layers} layers x {m.latent_width} values: kv_lora_rank "
            f"{m.kv_lora_rank} + rope {m.qk_rope_head_dim}); {full} bytes/token with full per-head keys and values "
            f"({heads} heads x (key {m.qk_head_dim} + value {m.v_head_dim})): {full / latent:.1f}x less")
