"""Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5): a `TokenMixer` over a per-sequence recurrent state.

Per token (transformers' Qwen3NextGatedDeltaNet, operation for operation):

    q, k, v, z, b, a = in_proj(x)              # one Linear: the checkpoint's projections stacked at load
    q, k, v = silu(causal_conv(q, k, v))       # depthwise conv over the last `conv_kernel` tokens of the sequence
    beta = sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias)
    o = gated_delta_rule(l2norm(q), l2norm(k), v, g, beta)      # models/mixers/gated_delta_rule.py, state [Hv, dk, dv]
    out = out_proj(rms_norm(o) * w * silu(z))  # per value head

Sequence memory (state/kinds.py RecurrentState): per sequence a slot holding the last conv_kernel - 1 conv inputs
(compute dtype) and the state (fp32); a sequence starting at position 0 starts from zeros, whatever its slot held.
Prompt tokens take the chunk form on a grid of CHUNK positions from 0 (the scheduler cuts prompts on that grid);
tokens after the prompt (decode, or recomputed output after a preemption) take the recurrent step: with the C++
kernels, a decode-only batch takes it in one `gated_delta_step_` call for every sequence (csrc/gated_delta.cpp, the
same bits as the torch step), otherwise `gated_delta_rule.recurrent_step` per sequence and token. With the C++
kernels the chunk form is `gated_delta_chunk_` (csrc/gated_delta_chunk.cpp: the same arithmetic in fixed-order
sums, within fp32 rounding of the torch form, not its bits), else `gated_delta_rule.chunk_form`; chosen once with
the kernels, so every prompt of a process takes the same one. Shapes: N tokens,
Hk / Hv key / value heads, dk / dv their dims, C = conv channels (q, k and v side by side).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from moeserve.models.layers.base import ForwardBatch, TokenMixer, not_in_gemv_layout
from moeserve.models.layers.linear import Linear
from moeserve.models.mixers.gated_delta_rule import CHUNK, chunk_form, l2norm, recurrent_step
from moeserve.models.numerics import Numerics
from moeserve.models.spec import LinearAttentionSpec
from moeserve.state.kv_cache import PagedKVCache

if TYPE_CHECKING:
    from moeserve.models.loader import WeightLoader
    from moeserve.models.registry import Architecture
    from moeserve.models.spec import ModelSpec


# (q, k, v, g, beta, state) -> outputs [n, Hv, dv]: gated_delta_rule.chunk_form's signature
ChunkForm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                     torch.Tensor]


def cpp_chunk_form(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> torch.Tensor:
    """gated_delta_rule.chunk_form in one C++ call (csrc/gated_delta_chunk.cpp), heads in parallel."""
    return torch.ops.moeserve.gated_delta_chunk_(q, k, v, g, beta, state)


class GatedDeltaNet(TokenMixer):
    def __init__(self, spec: LinearAttentionSpec, layer: int, in_proj: Linear, out_proj: Linear,
                 conv_weight: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, norm: torch.Tensor,
                 eps: float, numerics: Numerics = Numerics()) -> None:
        """in_proj: rows [q (Hk*dk), k (Hk*dk), v (Hv*dv), z (Hv*dv), b (Hv), a (Hv)]; conv_weight [C, K] (a view of
        the checkpoint's [C, 1, K]), a_log, dt_bias [Hv] and norm [dv], all in the compute dtype."""
        self.spec, self.layer = spec, layer
        self.in_proj, self.out_proj = in_proj, out_proj
        self.conv_weight = conv_weight
        self.a_log, self.dt_bias, self.norm, self.eps = a_log, dt_bias, norm, eps
        s = spec
        self.split = [s.conv_dim, s.value_dim, s.num_v_heads, s.num_v_heads]
        self.numerics = numerics  # the C++ ops: decode-only batches take gated_delta_step_
        self.chunk_form: ChunkForm = cpp_chunk_form if numerics.cpp else chunk_form  # prompt tokens

    def __call__(self, x: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        mixed, z, b, a = self.in_proj(x).split_with_sizes(self.split, dim=-1)  # [N, C], [N, Hv*dv], [N, Hv] x2
        conv_states, states = kv.recurrent(self.layer)
        slots = [table[0] for table in batch.tables[kv.group_of(self.layer)]]
        mixed = torch.cat([self._conv(mixed[off : off + n], conv_states[slot], start == 0)
                           for off, n, start, slot in self._pieces(batch, slots)])
        gates = torch.cat([b, a], dim=-1)
        qkv, beta, g, decay = self._rowwise(self._activate, mixed, gates)
        prompts = batch.prompt_lens or [s + n if n > 1 else s for s, n in zip(batch.starts, batch.num_new)]
        if self.numerics.cpp and batch.decode_only and self.stack_takes(batch):
            q, k, v = self._heads(qkv)
            core = torch.ops.moeserve.gated_delta_step_(q, k, v, decay, beta, states,
                                                        torch.tensor(slots, dtype=torch.long))
        else:
            outs = []
            for (off, n, start, slot), prompt in zip(self._pieces(batch, slots), prompts):
                state = states[slot]
                if start == 0:
                    state.zero_()
                rows = slice(off, off + n)
                outs.append(self._core(qkv[rows], g[rows], decay[rows], beta[rows], state, start, prompt))
            core = torch.cat(outs) if len(outs) > 1 else outs[0]  # [N, Hv, dv] fp32
        gated = self._rowwise(self._gated_norm, core.to(x.dtype).reshape(x.shape[0], -1), z)[0]
        return self.out_proj(gated)

    def _pieces(self, batch: ForwardBatch, slots: list[int]) -> list[tuple[int, int, int, int]]:
        """(offset in the batch, new tokens, first position, state slot) per sequence."""
        out, off = [], 0
        for n, start, slot in zip(batch.num_new, batch.starts, slots):
            out.append((off, n, start, slot))
            off += n
        return out

    def _conv(self, x: torch.Tensor, history: torch.Tensor, fresh: bool) -> torch.Tensor:
        """Causal depthwise conv of one sequence's new inputs x [n, C] after its last K-1 inputs `history`
        [K-1, C] (zeros for a fresh sequence; updated in place). Each output is one fp32 sum over the K taps in
        order, rounded once to the compute dtype: the same bits however the sequence's tokens are split."""
        if fresh:
            history.zero_()
        k = self.conv_weight.shape[1]
        padded = torch.cat([history, x])  # [K-1+n, C]
        n = x.shape[0]
        acc = padded[0:n].float() * self.conv_weight[:, 0]
        for j in range(1, k):
            acc = acc + padded[j : j + n].float() * self.conv_weight[:, j]
        history.copy_(padded[-(k - 1):])
        return acc.to(x.dtype)

    def _rowwise(self, fn: Callable[..., tuple[torch.Tensor, ...]], *parts: torch.Tensor) -> list[torch.Tensor]:
        """fn(*parts) for a row-wise fn of [N, ...] tensors of one dtype; batch-invariant: in fixed row blocks
        (element-wise ops round a tensor's vector tail otherwise, and which rows fall there must not depend on the
        batch). The blocks' outputs travel as fp32 (exact for bf16 and fp32) and return in their own dtypes."""
        if not self.numerics.batch_invariant:
            return list(fn(*parts))
        widths = [p.shape[1] for p in parts]
        layout: list[tuple[torch.Size, torch.dtype]] = []  # each output's row shape and dtype

        def block(t: torch.Tensor) -> torch.Tensor:
            pieces = fn(*torch.split(t, widths, dim=-1))
            layout[:] = [(p.shape[1:], p.dtype) for p in pieces]
            return torch.cat([p.reshape(p.shape[0], -1).float() for p in pieces], dim=-1)

        flat = self.numerics.rows(block, torch.cat(parts, dim=-1))
        sizes = [shape.numel() for shape, _ in layout]
        return [t.reshape(-1, *shape).to(dt) for t, (shape, dt) in zip(flat.split(sizes, dim=-1), layout)]

    def _activate(self, mixed: torch.Tensor, gates: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """silu of the conv outputs, and per value head beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)
        and the recurrent step's decay exp(g) (fp32)."""
        h = self.spec.num_v_heads
        b, a = gates[:, :h].to(self.dt_bias.dtype), gates[:, h:].to(self.dt_bias.dtype)
        beta = b.sigmoid().float()
        g = -self.a_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        return F.silu(mixed.to(self.dt_bias.dtype)), beta, g, g.exp()

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv outputs [n, C] -> q, k [n, Hv, dk] (fp32, L2-normalised, key heads repeated) and v [n, Hv, dv]."""
        s = self.spec
        n = qkv.shape[0]
        q, k, v = qkv.float().split_with_sizes([s.key_dim, s.key_dim, s.value_dim], dim=-1)
        rep = s.num_v_heads // s.num_k_heads
        q = l2norm(q.reshape(n, s.num_k_heads, s.k_head_dim)).repeat_interleave(rep, dim=1)
        k = l2norm(k.reshape(n, s.num_k_heads, s.k_head_dim)).repeat_interleave(rep, dim=1)
        return q, k, v.reshape(n, s.num_v_heads, s.v_head_dim)

    def _core(self, qkv: torch.Tensor, g: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,  # noqa: PLR0913
              state: torch.Tensor, start: int, prompt_len: int) -> torch.Tensor:
        """One sequence's tokens at positions [start, start + n): [n, Hv, dv] fp32."""
        n = qkv.shape[0]
        q, k, v = self._heads(qkv)
        cut = max(0, min(n, prompt_len - start))  # tokens of the prompt: chunk form; the rest: one by one
        outs = []
        if cut:
            outs.append(self.chunk_form(q[:cut], k[:cut], v[:cut], g[:cut], beta[:cut], state))
        for t in range(cut, n):
            outs.append(recurrent_step(q[t], k[t], v[t], decay[t], beta[t], state).unsqueeze(0))
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _gated_norm(self, core: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor]:
        """Per value head: RMSNorm(core) * w, times silu(z) in fp32, rounded to the compute dtype."""
        s = self.spec
        n = core.shape[0]
        dtype = self.norm.dtype
        h = core.to(dtype).reshape(n, s.num_v_heads, s.v_head_dim).float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.norm * h.to(dtype)
        out = h * F.silu(z.to(dtype).reshape(n, s.num_v_heads, s.v_head_dim).float())
        return (out.to(dtype).reshape(n, -1),)

    def linears(self) -> list[Linear]:
        return [self.in_proj, self.out_proj]

    def describe(self) -> str:
        """The start-up log's line: how prompt and decode tokens are computed, and why."""
        cpp = self.numerics.cpp
        how = "C++ gated_delta_chunk_" if cpp else "torch"
        step = ("C++ gated_delta_step_, one call per decode-only batch (the C++ kernels are on)" if cpp else
                "the torch recurrent step per sequence (kernels=torch, not CPU, or the C++ kernels are unavailable)")
        return (f"Gated DeltaNet: prompt tokens in chunks of {CHUNK} positions ({how}, fp32), later tokens by {step}; "
                "state slots per sequence in the sequence memory")

    def why_not_stacked(self) -> str | None:
        if self.in_proj.bias is not None or self.out_proj.bias is not None:
            return "a Gated DeltaNet projection with a bias"
        return not_in_gemv_layout(self.linears())

    def stack_takes(self, batch: ForwardBatch) -> bool:
        """Every token of the decode-only `batch` is past its prompt (the recurrent step: prompt tokens take the
        chunk form, which the stack does not run)."""
        prompts = batch.prompt_lens or batch.starts
        return all(s >= p for s, p in zip(batch.starts, prompts))

    def add_to_stack(self, stack: Any, kv: PagedKVCache, input_norm: torch.Tensor, post_norm: torch.Tensor) -> None:
        """__call__'s decode path (csrc/decode_stack_mixers.cpp GatedDeltaMixer): the same ops in the same order."""
        s = self.spec
        conv_states, states = kv.recurrent(self.layer)
        stack.add_gated_delta(input_norm, post_norm, *self.in_proj.gemv_tensors(), *self.out_proj.gemv_tensors(),
                              self.conv_weight, self.a_log, self.dt_bias, self.norm, conv_states, states,
                              [s.num_k_heads, s.num_v_heads, s.k_head_dim, s.v_head_dim, kv.group_of(self.layer)])


def build_gated_delta(load: WeightLoader, arch: Architecture, spec: ModelSpec, L: int,
                      numerics: Numerics) -> GatedDeltaNet:
    """Layer L's Gated DeltaNet from the checkpoint (`load`: a models.loader.WeightLoader). The input projections
    are stacked into one Linear with rows in the order GatedDeltaNet reads them: Qwen3-Next's, grouped per key
    head ([Hk, (q, k, v, z)] and [Hk, (b, a)]), are regrouped; Qwen3.5's are in that order already. Each output
    row is the same dot product either way: the same bits."""
    from moeserve.models.validate import linear_attention_parts

    la, names, h = spec.linear_attention, arch.names, spec.hidden_size
    assert la is not None
    weights = [load.linear_weight(prefix, rows, h) for prefix, rows in linear_attention_parts(arch, spec, L)]
    if la.projections == "qkvz_ba":
        weights = _regroup_qkvz_ba(la, weights[0], weights[1], h)
    in_proj = load.make_linear(torch.cat(weights), None)
    del weights

    def n(template: str) -> str:
        return template.format(L=L)

    conv = load.tensor(n(names.linear_conv), (la.conv_dim, 1, la.conv_kernel)).view(la.conv_dim, la.conv_kernel)
    return GatedDeltaNet(
        la, L, in_proj, load.linear(n(names.linear_out), h, la.value_dim), conv,
        load.tensor(n(names.linear_a_log), (la.num_v_heads,)), load.tensor(n(names.linear_dt_bias), (la.num_v_heads,)),
        load.tensor(n(names.linear_norm), (la.v_head_dim,)), spec.rms_norm_eps, numerics)


def _regroup_qkvz_ba(la: LinearAttentionSpec, qkvz: torch.Tensor, ba: torch.Tensor, h: int) -> list[torch.Tensor]:
    """Qwen3-Next's [Hk, (dk, dk, r*dv, r*dv)] and [Hk, (r, r)] rows (r = Hv / Hk) as [q, k, v, z, b, a]."""
    r, dk = la.num_v_heads // la.num_k_heads, la.k_head_dim
    w = qkvz.view(la.num_k_heads, -1, h)
    cuts = [dk, dk, r * la.v_head_dim, r * la.v_head_dim]
    parts = [p.reshape(-1, h) for p in w.split(cuts, dim=1)]
    return parts + [p.reshape(-1, h) for p in ba.view(la.num_k_heads, 2 * r, h).split([r, r], dim=1)]
