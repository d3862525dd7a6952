"""The n-gram per-layer embedding's injection (Qwen4-Exp PLE, ModelSpec.ngram), transformers' Qwen4ExpTextPLELayer
operation for operation, its causal conv state held by the caller:

    e      = the token's table rows, heads side by side [N, E]         (models/ngram.py: which rows)
    key    = grouped_norm(key_proj(e)) per stream    value = value_proj(e)     query = grouped_norm(h) per stream
    gate   = signed sqrt(|sum(key * query) / sqrt(H)|), floored at 1e-6   (per stream)
    g      = sigmoid(gate) * value                                    [N, S * H]
    out    = g + silu(dilated_conv(grouped_norm(g)))                   added to h by the decoder layer

The conv is depthwise, `conv_kernel` taps `ngram_size` positions apart, over the sequence's previous
(conv_kernel - 1) * ngram_size inputs (zeros before its start: `history`). Each output is one fp32 sum over the
taps in order, rounded once, and with batch-invariant numerics the row-wise parts run in fixed row blocks: the same
bits however the sequence's tokens are split into steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from moeserve.models.layers.hyper import grouped_rms_norm
from moeserve.models.numerics import Numerics

Project = Callable[[torch.Tensor], torch.Tensor]


class PleInjection:
    def __init__(self, key_proj: Project, value_proj: Project, norms: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                 conv_weight: torch.Tensor, streams: int, dilation: int, eps: float,
                 numerics: Numerics = Numerics()) -> None:
        """`norms`: the (1 + w) weights of norm_key, norm_query, norm_conv [S * H] in fp32; `conv_weight` [S * H, K]
        (the checkpoint's [S * H, 1, K])."""
        self.key_proj, self.value_proj = key_proj, value_proj
        self.norm_key, self.norm_query, self.norm_conv = norms
        self.conv_weight, self.streams, self.dilation, self.eps = conv_weight, streams, dilation, eps
        self.numerics = numerics  # batch-invariant: the row-wise parts in fixed row blocks

    @property
    def history_len(self) -> int:
        """The conv inputs a sequence keeps between steps."""
        return (self.conv_weight.shape[1] - 1) * self.dilation

    def __call__(self, h: torch.Tensor, rows: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        """What layer's PLE adds to h [n, S * H] of one sequence's new tokens, `rows` [n, E] their table rows;
        `history` [history_len, S * H] the sequence's last conv inputs (zeros at its start), updated in place."""
        width = h.shape[-1]
        both = self.numerics.rows(self._gated, torch.cat([h, rows], dim=-1))
        gated, normed = both[:, :width], both[:, width:]
        return gated + self.numerics.rows(F.silu, self._conv(normed, history))

    def _gated(self, x: torch.Tensor) -> torch.Tensor:
        """Row-wise: [h, rows] -> [the gated value g, grouped_norm(g)], each [N, S * H]."""
        s, width = self.streams, self.norm_query.shape[0]
        h, rows = x[:, :width], x[:, width:]
        hidden = width // s
        key = grouped_rms_norm(self.key_proj(rows), self.norm_key, s, self.eps).unflatten(-1, (s, hidden))
        value = self.value_proj(rows)
        query = grouped_rms_norm(h, self.norm_query, s, self.eps).unflatten(-1, (s, hidden))
        gate = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(hidden)
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        gated = (torch.sigmoid(gate) * value.unsqueeze(-2)).flatten(-2)
        return torch.cat([gated, grouped_rms_norm(gated, self.norm_conv, s, self.eps)], dim=-1)

    def _conv(self, x: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        n, taps = x.shape[0], self.conv_weight.shape[1]
        padded = torch.cat([history, x])  # [history_len + n, C]
        acc = padded[0:n].float() * self.conv_weight[:, 0].float()
        for j in range(1, taps):
            at = j * self.dilation
            acc = acc + padded[at: at + n].float() * self.conv_weight[:, j].float()
        history.copy_(padded[-self.history_len:])
        return acc.to(x.dtype)
