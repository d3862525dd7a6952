"""Hyper-connections (Qwen4-Exp, ModelSpec.hyper): the residual is S streams of the hidden state side by side
[N, S * H]; a `GatedResidual` before each mixer and MLP reads the part's input from them and says how much of the
part's output each stream gets back. transformers' Qwen4ExpTextGatedResidual, operation for operation:

    normed = rms_norm(h per stream) * (1 + w)            # fp32, cast back; one norm weight over all S * H
    mix    = sigmoid(up(silu(down(normed) / S)))          # [N, S * H]
    x      = mean over streams of (mix * normed)          # [N, H]: the part's input
    inject = 2 * sigmoid(inject_proj(normed) / S)         # [N, S]: the part's output weight per stream
    h      = h + inject * part(x)   (per stream)          # `add`

The last gated residual (before the LM head) has no inject_proj: its x is the final hidden state (no final norm).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

Project = Callable[[torch.Tensor], torch.Tensor]  # a Linear: [N, in] -> [N, out]


class GatedResidual:
    def __init__(self, norm: torch.Tensor, down: Project, up: Project, inject: Project | None, streams: int,
                 eps: float) -> None:
        """`norm`: the (1 + w) weight [S * H] in fp32 (zero-centred, offset at load)."""
        self.norm, self.down, self.up, self.inject = norm, down, up, inject
        self.streams, self.eps = streams, eps

    def normed(self, h: torch.Tensor) -> torch.Tensor:
        """Each stream of h [N, S * H] RMS-normed in fp32, times the weight in fp32, cast back."""
        x = h.float().unflatten(-1, (self.streams, -1))
        x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return (x * self.norm).to(h.dtype)

    def read(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the part's input x [N, H], the streams' weights [N, S] or None for the last one) of h [N, S * H]."""
        normed = self.normed(h)
        mix = torch.sigmoid(self.up(F.silu(self.down(normed) / self.streams)))
        x = (mix.unflatten(-1, (self.streams, -1)) * normed.unflatten(-1, (self.streams, -1))).mean(dim=-2)
        if self.inject is None:
            return x, None
        return x, 2 * torch.sigmoid(self.inject(normed) / self.streams)

    @staticmethod
    def add(h: torch.Tensor, out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """h [N, S * H] plus the part's output out [N, H] times each stream's weight [N, S]."""
        return h + (out.unsqueeze(-2) * weights.unsqueeze(-1)).flatten(-2)
