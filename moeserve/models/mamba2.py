"""Mamba-2 mixer (Nemotron-H): a `TokenMixer` over a per-sequence SSM state, operation for operation as
transformers' NemotronHMamba2Mixer (torch path):

    z, xBC, dt = in_proj(h)                    # z: the norm's gate [inner]; xBC: conv channels; dt [heads]
    x, B, C = silu(causal_conv(xBC) + bias)    # depthwise conv over the last conv_kernel inputs of the sequence
    dt = softplus(dt + dt_bias)                # clamped below at time_step_min for prompt tokens (transformers)
    y = SSD(x, dt, A = -exp(A_log), B, C) + D x   # state [heads, head_dim, state] per sequence (fp32)
    out = out_proj(gated_rms_norm(y, z))       # y * silu(z), RMS-normed per group of inner / n_groups channels

Prompt tokens take the chunked scan (`ssd_chunk`) on a grid of CHUNK positions from 0, each chunk zero-padded to
CHUNK tokens (a zero dt adds nothing to the state and decays nothing); the state is carried from chunk to chunk
in order, so a prompt prefilled in grid-aligned pieces (state/kinds.py RecurrentState.prefill_end) gives the same
bits as one pass. Tokens after the prompt (decode, or output recomputed after a preemption) take the
selective-state update (`ssd_step`), in the dtypes transformers' step uses. Which form a token takes depends on
its position only. Shapes: N tokens, H heads, P head_dim, G groups, S state size, C conv channels.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from moeserve.models.layers import ForwardBatch, TokenMixer
from moeserve.models.linear import Linear, in_row_blocks
from moeserve.models.spec import MambaSpec
from moeserve.state.kv_cache import PagedKVCache

CHUNK = 64  # tokens per chunk of the prefill scan (the grid prompts are cut on)


def segment_sum(a: torch.Tensor) -> torch.Tensor:
    """a [T, H] -> [H, T, T]: out[h, i, j] = sum of a[j+1 .. i, h] for j <= i, -inf above the diagonal (summed
    from the masked inputs, as transformers does: no difference of two long cumulative sums)."""
    t = a.shape[0]
    x = a.t()[..., None].expand(-1, t, t)  # [H, T(k), T(j)]
    x = x.masked_fill(~torch.tril(torch.ones(t, t, dtype=torch.bool, device=a.device), diagonal=-1), 0)
    out = torch.cumsum(x, dim=-2)
    return out.masked_fill(~torch.tril(torch.ones(t, t, dtype=torch.bool, device=a.device)), -torch.inf)


def ssd_chunk(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
              d: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One chunk of T tokens (fp32): x [T, H, P], dt [T, H], a [H], b / c [T, H, S], d [H]; `state` [H, P, S]
    is read and replaced by the state after the chunk. Returns y [T, H, P]."""
    da = dt * a  # [T, H]
    cum = torch.cumsum(da, dim=0)
    xdt = x * dt[..., None]
    decay = torch.exp(segment_sum(da))  # [H, T, T]
    scores = torch.einsum("lhn,shn->hls", c, b) * decay
    y = torch.einsum("hls,shp->lhp", scores, xdt)
    y = y + torch.einsum("lhn,hpn->lhp", c, state) * torch.exp(cum)[..., None]
    to_end = torch.exp(cum[-1:] - cum)  # [T, H]
    chunk_state = torch.einsum("lhn,lhp->hpn", b * to_end[..., None], xdt)
    state.copy_(state * torch.exp(cum[-1])[:, None, None] + chunk_state)
    return y + d[:, None] * x


def ssd_step(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
             d: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One token in the compute dtype: x [H, P], dt [H] (softplus'd), b / c [H, S], d [H]; `state` [H, P, S]
    fp32, updated in place. The discretised input dt * B * x is rounded to the compute dtype, and the state to it
    before C reads it, as transformers' mamba2_selective_state_update does. Returns y [H, P]."""
    da = torch.exp(dt.float() * a)  # [H]
    dbx = (dt[:, None] * b)[:, None, :] * x[..., None]  # [H, P, S] compute dtype
    state.copy_(state * da[:, None, None] + dbx)
    y = torch.bmm(state.to(c.dtype), c[..., None]).squeeze(-1)  # [H, P]
    return y + x * d[:, None]


class Mamba2Mixer(TokenMixer):
    def __init__(self, spec: MambaSpec, layer: int, in_proj: Linear, out_proj: Linear,  # noqa: PLR0913
                 conv: tuple[torch.Tensor, torch.Tensor | None], a_log: torch.Tensor, d: torch.Tensor,
                 dt_bias: torch.Tensor, norm: torch.Tensor, invariant: bool = False) -> None:
        """in_proj rows [z (inner), xBC (C), dt (H)]; conv = (weight [C, K], bias [C] or None); a_log, d, dt_bias [H]
        and norm [inner] in the compute dtype."""
        self.spec, self.layer = spec, layer
        self.in_proj, self.out_proj = in_proj, out_proj
        self.conv_weight, self.conv_bias = conv
        self.a = -torch.exp(a_log.float())  # [H] fp32
        self.d, self.dt_bias, self.norm = d, dt_bias, norm
        self.split = [spec.inner, spec.conv_dim, spec.num_heads]
        self.invariant = invariant

    def __call__(self, x: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        z, xbc, dt = self.in_proj(x).split_with_sizes(self.split, dim=-1)
        conv_states, states = kv.recurrent(self.layer)
        slots = [table[0] for table in batch.tables[kv.group_of(self.layer)]]
        pieces, off = [], 0
        for n, start, slot in zip(batch.num_new, batch.starts, slots):
            pieces.append((off, n, start, slot))
            off += n
        xbc = torch.cat([self._conv(xbc[o : o + n], conv_states[slot], start == 0) for o, n, start, slot in pieces])
        xbc = self._rows(F.silu, xbc)
        dt = self._rows(lambda t: F.softplus(t + self.dt_bias), dt)  # [N, H] compute dtype
        prompts = batch.prompt_lens or [s + n if n > 1 else s for s, n in zip(batch.starts, batch.num_new)]
        ys, stepped = [], []
        for (o, n, start, slot), prompt in zip(pieces, prompts):
            if start == 0:
                states[slot].zero_()
            cut = max(0, min(n, prompt - start))  # prompt tokens: the chunked scan; the rest: one by one
            ys.append(self._scan(xbc[o : o + cut], dt[o : o + cut], start, states[slot]))
            ys += [self._step(xbc[t], dt[t], states[slot]) for t in range(o + cut, o + n)]
            stepped += [False] * cut + [True] * (n - cut)
        y = torch.cat(ys).reshape(x.shape[0], -1)  # [N, inner] fp32 (the stepped rows hold compute-dtype values)
        flags = torch.tensor(stepped, dtype=torch.float32, device=x.device)[:, None]
        normed = self._rows(self._gated_norm, torch.cat([y, z.float(), flags], dim=-1))
        return self.out_proj(normed.to(x.dtype))

    def _rows(self, fn: Any, t: torch.Tensor) -> torch.Tensor:
        """fn of a row-wise op; batch-invariant: in fixed blocks of rows (element-wise ops round a tensor's
        vectorised tail otherwise, and which rows fall there must not depend on the batch)."""
        return in_row_blocks(fn, t) if self.invariant else fn(t)

    def _conv(self, x: torch.Tensor, history: torch.Tensor, fresh: bool) -> torch.Tensor:
        """Causal depthwise conv (+ bias) of one sequence's new inputs x [n, C] after its last K-1 inputs
        `history` [K-1, C] (zeros for a fresh sequence; updated in place): one fp32 sum per output over the K taps in
        order, rounded once to the compute dtype, whatever the split of the sequence."""
        if fresh:
            history.zero_()
        k, n = self.conv_weight.shape[1], x.shape[0]
        padded = torch.cat([history, x])  # [K-1+n, C]
        acc = padded[0:n].float() * self.conv_weight[:, 0]
        for j in range(1, k):
            acc = acc + padded[j : j + n].float() * self.conv_weight[:, j]
        if self.conv_bias is not None:
            acc = acc + self.conv_bias
        history.copy_(padded[-(k - 1):])
        return acc.to(x.dtype)

    def _split_xbc(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """xBC [n, C] -> x [n, H, P], B and C [n, H, S] (each group's B and C repeated for its heads)."""
        s, n = self.spec, xbc.shape[0]
        x, b, c = xbc.split_with_sizes([s.inner, s.n_groups * s.state_size, s.n_groups * s.state_size], dim=-1)
        rep = s.num_heads // s.n_groups
        b = b.reshape(n, s.n_groups, s.state_size).repeat_interleave(rep, dim=1)
        c = c.reshape(n, s.n_groups, s.state_size).repeat_interleave(rep, dim=1)
        return x.reshape(n, s.num_heads, s.head_dim), b, c

    def _scan(self, xbc: torch.Tensor, dt: torch.Tensor, start: int, state: torch.Tensor) -> torch.Tensor:
        """Prompt tokens at positions [start, start + n) in chunks of the CHUNK grid: y [n, H, P] fp32."""
        n = xbc.shape[0]
        if n == 0:
            return xbc.new_zeros((0, self.spec.num_heads, self.spec.head_dim), dtype=torch.float32)
        x, b, c = (t.float() for t in self._split_xbc(xbc))
        dt = dt.clamp(min=self.spec.time_step_min).float()
        d, outs, lo = self.d.float(), [], 0
        while lo < n:
            hi = min(n, lo + CHUNK - (start + lo) % CHUNK)
            pad = CHUNK - (hi - lo)
            parts = [F.pad(t[lo:hi], (0, 0) * (t.dim() - 1) + (0, pad)) for t in (x, dt, b, c)]
            outs.append(ssd_chunk(parts[0], parts[1], self.a, parts[2], parts[3], d, state)[: hi - lo])
            lo = hi
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _step(self, xbc: torch.Tensor, dt: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """One token after the prompt: y [1, H, P], rounded to the compute dtype, held in fp32."""
        x, b, c = (t[0] for t in self._split_xbc(xbc[None]))
        return ssd_step(x, dt, self.a, b, c, self.d, state).float()[None]

    def _gated_norm(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [n, 2 inner + 1] = (y fp32, z, stepped flag): y * silu(z) RMS-normed per group of inner / n_groups
        channels, times the weight: in fp32 for prompt tokens (the scan's fp32 output), after a rounding to the
        compute dtype for stepped tokens (the step's output dtype), as transformers' NemotronHRMSNormGated."""
        s, n = self.spec, rows.shape[0]
        y, z, stepped = rows.split_with_sizes([s.inner, s.inner, 1], dim=-1)
        h = (y * F.silu(z)).reshape(n, s.n_groups, -1)
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + s.eps)).reshape(n, s.inner)
        rounded = self.norm * h.to(self.norm.dtype)  # compute dtype
        return torch.where(stepped > 0, rounded.float(), self.norm.float() * h)

    def linears(self) -> list[Linear]:
        return [self.in_proj, self.out_proj]

    def why_not_stacked(self) -> str | None:
        return "a Mamba-2 mixer (no decode-stack mode yet)"

    def add_to_stack(self, stack: Any, kv: PagedKVCache, input_norm: torch.Tensor, post_norm: torch.Tensor) -> None:
        raise NotImplementedError("why_not_stacked refuses Mamba-2 layers")


def build_mamba(load: Any, arch: Any, spec: Any, L: int, invariant: bool) -> Mamba2Mixer:
    """Layer L's Mamba-2 mixer from the checkpoint (`load`: a models.loader.WeightLoader)."""
    m, names, h = spec.mamba, arch.names, spec.hidden_size

    def n(template: str) -> str:
        return template.format(L=L)

    rows = m.inner + m.conv_dim + m.num_heads
    conv = load.tensor(n(names.mamba_conv), (m.conv_dim, 1, m.conv_kernel)).view(m.conv_dim, m.conv_kernel)
    conv_bias = load.tensor(n(names.mamba_conv_bias), (m.conv_dim,)) if m.conv_bias else None
    heads = (m.num_heads,)
    return Mamba2Mixer(
        m, L, load.linear(n(names.mamba_in), rows, h, m.proj_bias), load.linear(n(names.mamba_out), h, m.inner,
                                                                                 m.proj_bias),
        (conv, conv_bias), load.tensor(n(names.mamba_a_log), heads), load.tensor(n(names.mamba_d), heads),
        load.tensor(n(names.mamba_dt_bias), heads), load.tensor(n(names.mamba_norm), (m.inner,)), invariant)
