"""Mamba-2 mixer (Nemotron-H): a `TokenMixer` over a per-sequence SSM state, operation for operation as
transformers' NemotronHMamba2Mixer (torch path):

    z, xBC, dt = in_proj(h)                    # z: the norm's gate [inner]; xBC: conv channels; dt [heads]
    x, B, C = silu(causal_conv(xBC) + bias)    # depthwise conv over the last conv_kernel inputs of the sequence
    dt = softplus(dt + dt_bias)                # clamped below at time_step_min for prompt tokens (transformers)
    y = SSD(x, dt, A = -exp(A_log), B, C) + D x   # state [heads, head_dim, state] per sequence (fp32)
    out = out_proj(gated_rms_norm(y, z))       # y * silu(z), RMS-normed per group of inner / n_groups channels

Prompt tokens take the SSD chunk scan on a grid of CHUNK positions from 0 (mamba2_ssd: `scan_torch` or C++
mamba2_scan_); the state is carried from chunk to chunk in order, so a prompt prefilled in grid-aligned pieces
(state/kinds.py RecurrentState.prefill_end) gives the same bits as one pass. Tokens after the prompt (decode, or
output recomputed after a preemption) take the selective-state update (`ssd_step`), in the dtypes transformers'
step uses. Which form a token takes depends on its position only. The conv, the scan and the selective-state
update run through `kernels` (models/mixers/mamba2_ssd.py: torch, or the C++ ops mamba2_conv_ / mamba2_scan_ /
mamba2_step_ for the whole batch in one call each), chosen once per process. Shapes: N tokens, H heads, P
head_dim, G groups, S state size, C conv channels.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from moeserve.models.layers.base import ForwardBatch, TokenMixer, not_in_gemv_layout
from moeserve.models.layers.linear import Linear
from moeserve.models.mixers.mamba2_ssd import Mamba2Kernels, Piece, TorchMamba2, choose_mamba2_kernels
from moeserve.models.numerics import Numerics
from moeserve.models.spec import MambaSpec
from moeserve.state.kv_cache import PagedKVCache


class Mamba2Mixer(TokenMixer):
    def __init__(self, spec: MambaSpec, layer: int, in_proj: Linear, out_proj: Linear,  # noqa: PLR0913
                 conv: tuple[torch.Tensor, torch.Tensor | None], a_log: torch.Tensor, d: torch.Tensor,
                 dt_bias: torch.Tensor, norm: torch.Tensor, numerics: Numerics = Numerics(),
                 kernels: Mamba2Kernels | None = None) -> None:
        """in_proj rows [z (inner), xBC (C), dt (H)]; conv = (weight [C, K], bias [C] or None); a_log, d, dt_bias [H]
        and norm [inner] in the compute dtype; `kernels` run the conv, the prompt scan and the selective-state
        update (torch if None)."""
        self.spec, self.layer = spec, layer
        self.in_proj, self.out_proj = in_proj, out_proj
        self.conv_weight, self.conv_bias = conv
        self.a = -torch.exp(a_log.float())  # [H] fp32
        self.d, self.dt_bias, self.norm = d, dt_bias, norm
        self.split = [spec.inner, spec.conv_dim, spec.num_heads]
        # Batch-invariant: the row-wise ops in fixed blocks of rows (element-wise ops round a tensor's vectorised
        # tail otherwise, and which rows fall there must not depend on the batch).
        self.numerics = numerics
        self.kernels = kernels or TorchMamba2()

    def __call__(self, x: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        z, xbc, dt = self.in_proj(x).split_with_sizes(self.split, dim=-1)
        conv_states, states = kv.recurrent(self.layer)
        slots = [table[0] for table in batch.tables[kv.group_of(self.layer)]]
        pieces, off = [], 0
        for n, start, slot in zip(batch.num_new, batch.starts, slots):
            pieces.append((off, n, start, slot))
            off += n
        xbc = self.numerics.rows(F.silu, self.kernels.conv(xbc, self.conv_weight, self.conv_bias, conv_states, pieces))
        dt = self.numerics.rows(lambda t: F.softplus(t + self.dt_bias), dt)  # [N, H] compute dtype
        prompts = batch.prompt_lens or [s + n if n > 1 else s for s, n in zip(batch.starts, batch.num_new)]
        s = self.spec
        y = x.new_empty((x.shape[0], s.num_heads, s.head_dim), dtype=torch.float32)
        stepped = [False] * x.shape[0]
        step_rows: list[int] = []
        step_slots: list[int] = []
        scans: list[Piece] = []
        for (o, n, start, slot), prompt in zip(pieces, prompts):
            if start == 0:
                states[slot].zero_()
            cut = max(0, min(n, prompt - start))  # prompt tokens: the chunked scan; the rest: one by one, after it
            if cut:
                scans.append((o, cut, start, slot))
            step_rows += range(o + cut, o + n)
            step_slots += [slot] * (n - cut)
        if scans:
            dt_scan = dt.clamp(min=s.time_step_min).float()  # [N, H] (transformers clamps prompt tokens' dt)
            self.kernels.scan(xbc, dt_scan, self.a, self.d.float(), states, y, scans, s)
        if step_rows:
            decay = self.numerics.rows(lambda t: torch.exp(t.float() * self.a), dt)  # [N, H] fp32
            y[step_rows] = self.kernels.step(xbc, dt, decay, self.d, states, step_rows, step_slots, s).float()
            for r in step_rows:
                stepped[r] = True
        flags = torch.tensor(stepped, dtype=torch.float32, device=x.device)[:, None]
        normed = self.numerics.rows(self._gated_norm, torch.cat([y.reshape(x.shape[0], -1), z.float(), flags], dim=-1))
        return self.out_proj(normed.to(x.dtype))

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

    def describe(self) -> str:
        """The start-up log's line: how prompt and later tokens are computed, and why."""
        return f"Mamba-2: {self.kernels.describe()}; state slots per sequence in the sequence memory"

    def why_not_stacked(self) -> str | None:
        return not_in_gemv_layout(self.linears())

    def stack_takes(self, batch: ForwardBatch) -> bool:
        """Every token of the decode-only `batch` is past its prompt (the selective-state update: prompt tokens take
        the chunk scan, which the stack does not run)."""
        prompts = batch.prompt_lens or batch.starts
        return all(s >= p for s, p in zip(batch.starts, prompts))

    def add_to_stack(self, stack: Any, kv: PagedKVCache, input_norm: torch.Tensor, post_norm: torch.Tensor) -> None:
        """__call__'s path for tokens after their prompts with the C++ kernels (csrc/decode_stack_mamba2.cpp
        Mamba2Mixer): the same ops in the same order, the same row blocks."""
        s = self.spec
        conv_states, states = kv.recurrent(self.layer)
        stack.add_mamba2(input_norm, post_norm, *self.in_proj.gemv_tensors(), self.in_proj.bias,
                         *self.out_proj.gemv_tensors(), self.out_proj.bias, self.conv_weight, self.conv_bias, self.a,
                         self.d, self.dt_bias, self.norm, conv_states, states,
                         [s.num_heads, s.head_dim, s.n_groups, s.state_size, kv.group_of(self.layer)], s.eps)


def build_mamba(load: Any, arch: Any, spec: Any, L: int, numerics: Numerics) -> Mamba2Mixer:
    """Layer L's Mamba-2 mixer from the checkpoint (`load`: a models.loader.WeightLoader); `numerics.cpp`: the
    moeserve C++ ops compute (mamba2_ssd.choose_mamba2_kernels)."""
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
        load.tensor(n(names.mamba_dt_bias), heads), load.tensor(n(names.mamba_norm), (m.inner,)), numerics,
        choose_mamba2_kernels(numerics))
