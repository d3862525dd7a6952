"""Grouped-query attention over the paged KV cache (the `TokenMixer` of most architectures).

Shapes: N = new tokens in the batch (all sequences flattened), nh / nkv = query / key-value heads, d = head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from moeserve.models.layers.base import ForwardBatch, Rotary, TokenMixer, not_in_gemv_layout, rms_norm
from moeserve.models.layers.linear import Linear
from moeserve.models.mixers.query_blocks import QUERY_BLOCK, query_blocks
from moeserve.models.numerics import Numerics
from moeserve.models.spec import AttentionSpec
from moeserve.state.kv_cache import PagedKVCache


class Attention(TokenMixer):
    """Grouped-query attention over the paged KV cache; optional q/k norm, biases, sinks, sliding window, value
    norm and keys as values (Gemma-4: `spec.v_norm`, `spec.k_eq_v`; they run in torch before the C++ op).

    q, k and v come from one fused Linear (weights stacked at load: one GEMV instead of three, the same bits), and
    with `spec.output_gate` a fourth part, the gate [N, nh*d]: the output is multiplied by sigmoid(gate) before
    o_proj (Qwen3-Next). `qk_norm` is the per-head norm function (rms_norm; rms_norm_fp32_scale for zero-centred
    norms, which the C++ op does not do: they run in torch before it). With `numerics.cpp` (the moeserve C++ ops are
    loaded), the per-head q/k norm, the rotary embedding and the KV write run as one op, and decode-only batches
    attend with one op; the torch path is kept operation for operation as transformers computes it and is what
    `kernels=torch` runs.
    """

    def __init__(
        self,
        spec: AttentionSpec,
        layer: int,
        qkv: Linear,
        o: Linear,
        q_norm: torch.Tensor | None,
        k_norm: torch.Tensor | None,
        sinks: torch.Tensor | None,
        rotary: Rotary,
        eps: float,
        numerics: Numerics = Numerics(),
        qk_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] = rms_norm,
        v_norm: torch.Tensor | None = None,
    ) -> None:
        self.spec, self.layer = spec, layer
        self.qkv, self.o = qkv, o
        q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        # keys as values (spec.k_eq_v): no v rows, the values are the keys as projected
        self.split = [q_size, kv_size] + ([] if spec.k_eq_v else [kv_size]) + ([q_size] if spec.output_gate else [])
        self.qk_norm = qk_norm
        self.q_norm, self.k_norm, self.sinks = q_norm, k_norm, sinks
        self.v_norm = v_norm  # [d] ones (a norm without weight, spec.v_norm), in the norm's weight dtype, or None
        self._sinks_f32 = None if sinks is None else sinks.float().contiguous()  # the C++ op's form
        self.rotary, self.eps = rotary, eps
        self.window = spec.sliding_window[layer]
        self.scale = spec.softmax_scale
        self.numerics = numerics  # the C++ ops; batch-invariant: the torch path attends in aligned query blocks

    def __call__(self, x: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        s = self.spec
        n = x.shape[0]
        q, k, *rest = self.qkv(x).split_with_sizes(self.split, dim=-1)  # [N, nh*d], [N, nkv*d] (views)
        v, gate = (k, rest) if s.k_eq_v else (rest[0], rest[1:])  # [N, nkv*d], the output gate if any
        if self.v_norm is not None:  # per head, before the keys' own norm (which makes new tensors)
            v = self.qk_norm(v.reshape(n, s.num_kv_heads, s.head_dim), self.v_norm, self.eps).reshape(n, -1)
        if s.qk_norm == "full":
            assert self.q_norm is not None and self.k_norm is not None
            q, k = rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps)
        if s.clip_qkv is not None:
            q, k, v = (t.clamp(-s.clip_qkv, s.clip_qkv) for t in (q, k, v))
        if self.numerics.cpp:
            if self.qk_norm is not rms_norm and s.qk_norm == "per_head":  # a norm the C++ op does not do
                q, k = self._per_head_norms(q, k, n)
            out = self._cpp_attention(q, k, v, batch, kv)
            return self.o(self._gated(out.reshape(n, s.num_heads * s.head_dim), gate))
        q = q.view(n, s.num_heads, s.head_dim)
        k = k.view(n, s.num_kv_heads, s.head_dim)
        v = v.view(n, s.num_kv_heads, s.head_dim)
        if s.qk_norm == "per_head":
            q, k = self._per_head_norms(q, k, n)
            q, k = q.view(n, s.num_heads, s.head_dim), k.view(n, s.num_kv_heads, s.head_dim)
        q = self.rotary.apply(q, batch.positions)
        k = self.rotary.apply(k, batch.positions)
        if self.numerics.batch_invariant:
            self._write(k, v, batch, kv)
            out = self._aligned_blocks(q, batch, kv)
        elif batch.decode_only and len(batch.num_new) > 1 and _padding_is_small(batch.starts, self.rotary.cos.shape[0]):
            out = self._decode_batched(q, k, v, batch, kv)
        else:
            out = self._per_sequence(q, k, v, batch, kv)
        return self.o(self._gated(out.reshape(n, s.num_heads * s.head_dim), gate))

    def _per_head_norms(self, q: torch.Tensor, k: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k normed per head with `self.qk_norm`, as [N, nh*d] and [N, nkv*d]."""
        s = self.spec
        assert self.q_norm is not None and self.k_norm is not None
        q = self.qk_norm(q.reshape(n, s.num_heads, s.head_dim), self.q_norm, self.eps)
        k = self.qk_norm(k.reshape(n, s.num_kv_heads, s.head_dim), self.k_norm, self.eps)
        return q.reshape(n, -1), k.reshape(n, -1)

    def _gated(self, out: torch.Tensor, gate: list[torch.Tensor]) -> torch.Tensor:
        """out * sigmoid(gate) with an output gate (in the compute dtype, as transformers), else out."""
        if not gate:
            return out
        if self.numerics.batch_invariant:  # element-wise ops in fixed row blocks (vector tails must not move with N)
            both = torch.cat([out, gate[0]], dim=-1)
            return self.numerics.rows(lambda t: t[:, : out.shape[1]] * torch.sigmoid(t[:, out.shape[1]:]), both)
        return out * torch.sigmoid(gate[0])

    def describe(self) -> str:
        """The start-up log's line: what attends the prompt and the decode tokens, and why."""
        softmax = "explicit softmax with the sinks' logit (torch matmuls)" if self.sinks is not None else \
            "torch scaled_dot_product_attention"
        if self.numerics.cpp and self.numerics.batch_invariant:
            return ("C++ qk_norm_rope_cache, then C++ decode_attention for every token, prompt included: each query "
                    "row alone in one stated order (csrc/attention_core.h: the same bits on every ISA), prompt rows "
                    "in tiles of queries per pass over the keys")
        if self.numerics.cpp:
            return (f"C++ decode_attention for decode-only batches; prompts and mixed batches by {softmax} per "
                    "sequence (batch_invariant=false)")
        if self.numerics.batch_invariant:
            return (f"{softmax} in query blocks of {QUERY_BLOCK} aligned positions (batch-invariant; the C++ kernels "
                    "are off)")
        return f"{softmax} per sequence, decode batches in one padded call (batch_invariant=false, the C++ kernels off)"

    def linears(self) -> list[Linear]:
        return [self.qkv, self.o]

    def why_not_stacked(self) -> str | None:
        """None when the fused decode stack can run this attention, else why not (one line)."""
        s = self.spec
        if s.sinks or s.clip_qkv is not None or s.qk_norm == "full" or s.v_norm or s.k_eq_v:
            return "attention sinks, qkv clipping, a full-width q/k norm, value norms or keys as values"
        return not_in_gemv_layout(self.linears())

    def add_to_stack(self, stack: Any, kv: PagedKVCache, input_norm: torch.Tensor, post_norm: torch.Tensor) -> None:
        """As __call__'s C++ path: a per-head norm the C++ op does not do (zero-centred) runs as torch ops in the
        stack too; an output gate is the fourth part of the qkv Linear."""
        s = self.spec
        per_head = s.qk_norm == "per_head"
        k_cache, v_cache = kv.layer(self.layer)
        sizes = [s.num_heads, s.num_kv_heads, s.head_dim, self.window or 0, kv.group_of(self.layer),
                 int(s.output_gate), int(per_head and self.qk_norm is not rms_norm)]
        stack.add_attention(input_norm, post_norm, *self.qkv.gemv_tensors(), self.qkv.bias, *self.o.gemv_tensors(),
                            self.o.bias, self.q_norm if per_head else None, self.k_norm if per_head else None,
                            self.rotary.cos, self.rotary.sin, k_cache, v_cache, sizes, self.scale)

    def _cpp_attention(self, q, k, v, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        """One op normalises (per head, unless __call__ did: a zero-centred norm), rotates and caches; a second
        attends every token (batch-invariant)."""
        per_head = self.spec.qk_norm == "per_head" and self.qk_norm is rms_norm
        kc, vc = kv.layer(self.layer)
        g = kv.group_of(self.layer)
        q = torch.ops.moeserve.qk_norm_rope_cache(
            q, k, v, self.q_norm if per_head else None, self.k_norm if per_head else None, self.rotary.cos,
            self.rotary.sin, batch.positions, batch.slot_mappings[g], kc, vc, self.eps)  # [N, nh, d]
        # Every token, prefill or decode, alone or beside others: one op that attends each query row on its own
        # (keys up to its position), with one fixed reduction order, so a request's numbers never depend on the batch.
        # batch_invariant=False: prefill and mixed batches take torch's attention (flash SDPA) as before.
        if not self.numerics.batch_invariant and not batch.decode_only:
            return self._per_sequence(q, None, None, batch, kv)
        return torch.ops.moeserve.decode_attention(q, kc, vc, batch.block_tables[g], batch.rows, batch.positions,
                                                   self.window or 0, self.scale, self._sinks_f32)

    def _write(self, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache) -> None:
        """k, v [N, nkv, d] into their cache rows."""
        kc, vc = kv.layer(self.layer)
        rows = batch.slot_mappings[kv.group_of(self.layer)]
        blocks, offsets = rows // kv.block_size, rows % kv.block_size
        kc[blocks, :, offsets] = k
        vc[blocks, :, offsets] = v

    def _gather(self, cache: torch.Tensor, table: list[int], lo: int, end: int, bs: int) -> torch.Tensor:
        """Positions [lo, end) of one sequence from `cache` [blocks, nkv, bs, d]: [nkv, end - lo, d]."""
        first = lo // bs
        ids = torch.tensor(table[first : -(-end // bs)], dtype=torch.long, device=cache.device)
        rows = cache[ids].transpose(0, 1).reshape(cache.shape[1], -1, cache.shape[3])
        return rows[:, lo - first * bs : end - first * bs]

    def _per_sequence(self, q, k, v, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        """Prefill or mixed batches: attend sequence by sequence against its cached prefix. k and v are None
        when the new tokens' keys and values are in the cache already."""
        if k is not None and v is not None:
            self._write(k, v, batch, kv)
        kc, vc = kv.layer(self.layer)  # [blocks, nkv, bs, d]
        tables, bs = batch.tables[kv.group_of(self.layer)], kv.block_size
        outs, off = [], 0
        for table, start, num in zip(tables, batch.starts, batch.num_new):
            end = start + num
            q_s = q[off : off + num].transpose(0, 1).unsqueeze(0)  # [1, nh, num, d]
            lo = 0 if self.window is None else max(0, end - num - self.window + 1)
            keys = self._gather(kc, table, lo, end, bs).unsqueeze(0)  # [1, nkv, L, d]
            values = self._gather(vc, table, lo, end, bs).unsqueeze(0)
            q_pos = torch.arange(start, end, device=q.device)[:, None]
            k_pos = torch.arange(lo, end, device=q.device)[None, :]
            visible = k_pos <= q_pos
            if self.window is not None:
                visible &= k_pos > q_pos - self.window
            outs.append(self._attend(q_s, keys, values, visible)[0].transpose(0, 1))  # [num, nh, d]
            off += num
        return torch.cat(outs, dim=0) if len(outs) > 1 else outs[0]

    def _aligned_blocks(self, q, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        """Batch-invariant torch attention: queries in blocks of QUERY_BLOCK positions aligned to multiples of it
        (rows outside the step zero-padded), each block against the keys from its first row's window start to its
        end (later ones masked). A block's call shape depends only on its positions, never on how the sequence
        was chunked, batched or taken from the prefix cache, so neither does any row's result (masked keys get
        probability exactly 0)."""
        kc, vc = kv.layer(self.layer)
        tables, bs = batch.tables[kv.group_of(self.layer)], kv.block_size
        outs = []
        for blk in query_blocks(batch, bs):
            a, r, table = blk.first, blk.size, tables[blk.seq]
            lo = 0 if self.window is None else max(0, a - self.window + 1)
            keys = self._gather(kc, table, lo, a + r, bs).unsqueeze(0)  # [1, nkv, L, d]
            values = self._gather(vc, table, lo, a + r, bs).unsqueeze(0)
            q_pos = torch.arange(a, a + r, device=q.device)[:, None]
            k_pos = torch.arange(lo, a + r, device=q.device)[None, :]
            visible = k_pos <= q_pos
            if self.window is not None:
                visible &= k_pos > q_pos - self.window
            out = self._attend(blk.padded(q).transpose(0, 1).unsqueeze(0), keys, values, visible)[0].transpose(0, 1)
            outs.append(blk.own(out))
        return torch.cat(outs, dim=0) if len(outs) > 1 else outs[0]

    def _decode_batched(self, q, k, v, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        """Every sequence adds one token: one padded attention call for the whole batch."""
        self._write(k, v, batch, kv)
        kc, vc = kv.layer(self.layer)
        table = batch.block_tables[kv.group_of(self.layer)]  # [B, W]
        pos = batch.positions  # [B]
        length = max(batch.starts) + 1
        width = -(-length // kv.block_size)
        b, nkv, d = table.shape[0], kc.shape[1], kc.shape[3]

        def gather(cache: torch.Tensor) -> torch.Tensor:  # [B, W, nkv, bs, d] -> [B, nkv, L, d]
            return cache[table[:, :width]].transpose(1, 2).reshape(b, nkv, -1, d)[:, :, :length]

        keys, values = gather(kc), gather(vc)
        k_pos = torch.arange(length, device=q.device)[None, :]
        visible = k_pos <= pos[:, None]  # [B, L]
        if self.window is not None:
            visible &= k_pos > pos[:, None] - self.window
        out = self._attend(q.unsqueeze(2), keys, values, visible[:, None, None, :])  # [B, nh, 1, d]
        return out.squeeze(2)

    def _attend(self, q, keys, values, visible: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T * scale + mask) v, with GQA; with sinks, an extra per-head logit joins the softmax."""
        if self.sinks is None:
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=self.scale,
                                                  enable_gqa=True)
        group = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        scores = torch.matmul(q, keys.transpose(-1, -2)) * self.scale
        scores = scores.masked_fill(~visible, float("-inf"))
        sinks = self.sinks.view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1).to(scores.dtype)
        combined = torch.cat([scores, sinks], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1)[..., :-1]
        return torch.matmul(probs.to(values.dtype), values)


def _padding_is_small(starts: list[int], max_len: int) -> bool:
    """A padded batched decode gathers every sequence at the longest one's length: one call, worth it only while
    that copy is at most twice the tokens really attended and no more than one sequence of the longest context
    (`max_len`), which the memory split's activation bound counts (memory/split.py); otherwise sequence by sequence."""
    padded = len(starts) * (max(starts) + 1)
    return padded <= 2 * (sum(starts) + len(starts)) and padded <= max_len
