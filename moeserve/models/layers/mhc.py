"""Manifold-constrained hyper-connections (DeepSeek-V4, ModelSpec.mhc): the residual is S streams [N, S, H]. Before
each mixer and each MLP an `MhcMix` reads them, operation for operation as transformers' DeepseekV4HyperConnection:

    w      = fn @ unweighted_rms_norm(streams flattened, fp32)             # [N, (2 + S) * S], fp32
    pre    = sigmoid(w_pre * scale_pre + base_pre) + eps                   # [N, S]: the part's input weights
    post   = 2 * sigmoid(w_post * scale_post + base_post)                  # [N, S]: its output's weight per stream
    comb   = softmax(w_comb * scale_comb + base_comb, rows) + eps          # [N, S, S], then Sinkhorn-Knopp:
             columns, then (rows, columns) x (sinkhorn_iters - 1), each normalised to sum 1 (+ eps)
    x      = sum_s pre_s * stream_s                                        # the part's input, in the streams' dtype
    h'     = post * part(x) + comb^T @ h                                   # `add`, in the streams' dtype

The head's `MhcHead` collapses the streams the same way (its own fn, base, one scale; no post or comb) before the
final norm. Pure functions of one token's row: batch-invariant in fixed row blocks (`Numerics.rows`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeserve.models.numerics import Numerics


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' DeepseekV4UnweightedRMSNorm: x times rsqrt(mean(x^2) + eps) (computed in fp32), in x's dtype."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class MhcMix:
    def __init__(self, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, streams: int, iters: int,
                 hc_eps: float, norm_eps: float, numerics: Numerics = Numerics()) -> None:
        """`fn` [(2 + S) * S, S * H], `base` [(2 + S) * S], `scale` [3], all fp32 (as transformers keeps them)."""
        self.fn, self.base, self.scale = fn.float(), base.float(), scale.float()
        self.streams, self.iters, self.hc_eps, self.norm_eps = streams, iters, hc_eps, norm_eps
        self.numerics = numerics

    def read(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x [N, H] in h's dtype: the part's input, post [N, S] and comb [N, S, S] in fp32) of h [N, S, H]."""
        s = self.streams
        packed = self.numerics.rows(self._read, h.flatten(1))  # [N, H + S + S * S] fp32 (x exact in it)
        hidden = h.shape[-1]
        x = packed[:, :hidden].to(h.dtype)
        return x, packed[:, hidden:hidden + s], packed[:, hidden + s:].unflatten(-1, (s, s))

    def _read(self, flat: torch.Tensor) -> torch.Tensor:
        s = self.streams
        mixes = F.linear(unweighted_rms_norm(flat.float(), self.norm_eps), self.fn)
        pre_w, post_w, comb_w = mixes.split([s, s, s * s], dim=-1)
        pre_b, post_b, comb_b = self.base.split([s, s, s * s])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.unflatten(-1, (s, s)) * comb_s + comb_b.view(s, s), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        streams = flat.unflatten(-1, (s, -1))
        x = (pre.unsqueeze(-1) * streams).sum(dim=1).to(flat.dtype).float()
        return torch.cat([x, post, comb.flatten(1)], dim=-1)

    @staticmethod
    def add(h: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """The new streams [N, S, H]: post * out per stream plus comb^T mixing the old streams, in h's dtype."""
        return post.to(h.dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(h.dtype).transpose(-1, -2), h)


class MhcHead:
    def __init__(self, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float, norm_eps: float,
                 numerics: Numerics = Numerics()) -> None:
        """transformers' DeepseekV4HyperHead: `fn` [S, S * H], `base` [S], `scale` [1] (fp32)."""
        self.fn, self.base, self.scale = fn.float(), base.float(), scale.float()
        self.hc_eps, self.norm_eps, self.numerics = hc_eps, norm_eps, numerics

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """The final hidden state [N, H] (h's dtype) of the streams h [N, S, H]."""
        streams = h.shape[1]
        return self.numerics.rows(lambda flat: self._collapse(flat, streams), h.flatten(1))

    def _collapse(self, flat: torch.Tensor, streams: int) -> torch.Tensor:
        mixes = F.linear(unweighted_rms_norm(flat.float(), self.norm_eps), self.fn)
        pre = torch.sigmoid(mixes * self.scale + self.base) + self.hc_eps
        return (pre.unsqueeze(-1) * flat.unflatten(-1, (streams, -1))).sum(dim=1).to(flat.dtype)
