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

from moeserve.models.numerics import Numerics

Project = Callable[[torch.Tensor], torch.Tensor]  # a Linear: [N, in] -> [N, out]


def grouped_rms_norm(h: torch.Tensor, weight: torch.Tensor, streams: int, eps: float) -> torch.Tensor:
    """Each of the `streams` parts of h [N, S * H] RMS-normed in fp32, times `weight` [S * H] (fp32), cast back:
    transformers' Qwen4ExpTextRMSNorm with group_size = H."""
    x = h.float().unflatten(-1, (streams, -1))
    x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)
    return (x * weight).to(h.dtype)


class GatedResidual:
    def __init__(self, norm: torch.Tensor, down: Project, up: Project, inject: Project | None, streams: int,
                 eps: float, numerics: Numerics = Numerics()) -> None:
        """`norm`: the (1 + w) weight [S * H] in fp32 (zero-centred, offset at load); batch-invariant `numerics`:
        computed in fixed row blocks."""
        self.norm, self.down, self.up, self.inject = norm, down, up, inject
        self.streams, self.eps, self.numerics = streams, eps, numerics

    def normed(self, h: torch.Tensor) -> torch.Tensor:
        """Each stream of h [N, S * H] RMS-normed in fp32, times the weight in fp32, cast back."""
        return grouped_rms_norm(h, self.norm, self.streams, self.eps)

    def read(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the part's input x [N, H], the streams' weights [N, S] or None for the last one) of h [N, S * H]."""
        both = self.numerics.rows(self._read, h)
        hidden = h.shape[-1] // self.streams
        return both[:, :hidden], (both[:, hidden:] if self.inject is not None else None)

    def _read(self, h: torch.Tensor) -> torch.Tensor:
        """Row-wise: [x, weights] side by side ([x] for the last one)."""
        normed = self.normed(h)
        mix = torch.sigmoid(self.up(F.silu(self.down(normed) / self.streams)))
        x = (mix.unflatten(-1, (self.streams, -1)) * normed.unflatten(-1, (self.streams, -1))).mean(dim=-2)
        if self.inject is None:
            return x
        return torch.cat([x, 2 * torch.sigmoid(self.inject(normed) / self.streams)], dim=-1)

    @staticmethod
    def add(h: torch.Tensor, out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """h [N, S * H] plus the part's output out [N, H] times each stream's weight [N, S]."""
        return h + (out.unsqueeze(-2) * weights.unsqueeze(-1)).flatten(-2)
