"""DeepSeek-V4's compressors (ModelSpec.compressed): each window of `ratio` tokens pooled into one entry of `width`
values, operation for operation as transformers' DeepseekV4HCACompressor / DeepseekV4CSACompressor (and the
indexer's own compressor, at index_head_dim):

    kv, gate = wkv(x), wgate(x) + ape[slot in window]         # per token; gate in fp32 (ape is)
    entry_w  = rms_norm(sum_slots softmax(gate, slots) * kv)   # fp32 softmax, its weights in kv's dtype; norm weight fp32
    entry_w  = rope_tail(entry_w, at position w * ratio)      # the compressed layers' rotary (compress_rope)

Overlapping windows (`overlap`: compressed sparse attention and its indexer): each token projects two series of
`width` values; entry w pools the second series of window w's tokens with the first series of window w - 1's (none
for w = 0: weight 0), 2 x ratio slots. An entry is a function of its own windows' tokens only: the same bits
whatever the call that computes it (a prompt whole or in chunks, a decode step), which the chunk and batch
invariance of the attention reading it needs.
"""

from __future__ import annotations

import torch

from moeserve.models.layers.base import rope_inv_freq
from moeserve.models.spec import RopeSpec


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' DeepSeek-V4 apply_rotary_pos_emb: the last 2 * cos.shape[-1] values of x [..., D] rotated in
    interleaved pairs (x0, x1), (x2, x3)... in fp32 with cos / sin [..., r/2] (in x's dtype), cast back; the leading
    values pass. `-sin` rotates back."""
    cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    r = cos.shape[-1]
    rest, rot = x[..., :-r], x[..., -r:]
    turned = torch.stack((-rot[..., 1::2], rot[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([rest, (rot.float() * cos + turned.float() * sin).to(x.dtype)], dim=-1)


class RopeTable:
    """cos and sin [max_len, r/2] of a RopeSpec over r rotated dims, computed as transformers' DeepseekV4RotaryEmbedding
    (positions times the inverse frequencies in fp32, times the attention factor), read at positions in a dtype."""

    def __init__(self, spec: RopeSpec, rotary_dim: int, max_len: int, device: torch.device) -> None:
        inv_freq, scaling = rope_inv_freq(spec, rotary_dim)
        freqs = torch.arange(max_len, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        self.cos, self.sin = (freqs.cos() * scaling).to(device), (freqs.sin() * scaling).to(device)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


class Compressor:
    def __init__(self, ape: torch.Tensor, norm: torch.Tensor, ratio: int, width: int, overlap: bool,
                 rope: RopeTable, eps: float) -> None:
        """`ape` [ratio, series * width] and the norm weight [width] in fp32 (as transformers keeps them)."""
        self.ape, self.norm, self.ratio, self.width, self.overlap = ape.float(), norm.float(), ratio, width, overlap
        self.rope, self.eps = rope, eps

    def entries(self, kv: torch.Tensor, gate: torch.Tensor, first: int) -> torch.Tensor:
        """The entries [n, width] of windows [first, first + n) from their tokens' projections kv, gate [T, series *
        width] (positions [first * ratio, (first + n) * ratio), and with overlapping windows the ratio tokens of
        window first - 1 before them when first > 0)."""
        r = self.ratio
        kv = kv.view(1, -1, r, kv.shape[-1])
        gate = gate.view(1, -1, r, gate.shape[-1]) + self.ape
        if self.overlap:
            kv, gate = self._overlapped(kv, gate, before=first > 0)
        n = kv.shape[1]
        pooled = (kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2)[0]  # [n, d]
        normed = (self.norm * _unit_rms(pooled.float(), self.eps)).to(pooled.dtype)
        positions = (torch.arange(n, device=kv.device) + first) * r
        cos, sin = self.rope.at(positions, normed.dtype)
        return rope_tail(normed, cos, sin)

    def _overlapped(self, kv: torch.Tensor, gate: torch.Tensor, before: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """[1, n, 2r, d]: window w's first r slots the first series of window w - 1 (kv 0, gate -inf: none), its last
        r the second series of its own tokens; `before`: kv / gate begin with the window before the first."""
        r, d = self.ratio, self.width
        own = slice(1, None) if before else slice(0, None)
        n = kv.shape[1] - (1 if before else 0)
        new_kv = kv.new_zeros((1, n, 2 * r, d))
        new_gate = gate.new_full((1, n, 2 * r, d), float("-inf"))
        new_kv[:, :, r:] = kv[:, own, :, d:]
        new_gate[:, :, r:] = gate[:, own, :, d:]
        if before:
            new_kv[:, :, :r], new_gate[:, :, :r] = kv[:, :-1, :, :d], gate[:, :-1, :, :d]
        elif n > 1:
            new_kv[:, 1:, :r], new_gate[:, 1:, :r] = kv[:, :-1, :, :d], gate[:, :-1, :, :d]
        return new_kv, new_gate


def _unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
