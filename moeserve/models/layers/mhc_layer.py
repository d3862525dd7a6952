"""A DeepSeek-V4 decoder layer over the manifold-constrained hyper-connection streams (models/layers/mhc.py), its
clamped shared expert, and the layer pass that carries the streams from the embedding to the LM head, as
transformers' DeepseekV4DecoderLayer / DeepseekV4Model:

    h = embedding repeated into S streams                                  [N, S, H]
    per layer:  x, post, comb = attn_mix.read(h);  h = add(h, mixer(norm(x)), post, comb)
                x, post, comb = mlp_mix.read(h);   h = add(h, moe(norm(x), token ids), post, comb)
    last = final_norm(head(h of each sequence's last token))
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from moeserve.models.layers.base import (
    MLP,
    DecoderLayer,
    DenseMLP,
    ForwardBatch,
    TokenMixer,
    rms_norm_fp32_scale,
)
from moeserve.models.layers.linear import Linear
from moeserve.models.layers.mhc import MhcHead, MhcMix
from moeserve.models.numerics import Numerics
from moeserve.models.passes import LayerPass
from moeserve.state.kv_cache import PagedKVCache


class ClampedMLP(DenseMLP):
    """DeepSeek-V4's shared expert: down(silu(min(gate, limit)) * clamp(up, -limit, limit))."""

    def __init__(self, gate: Linear, up: Linear, down: Linear, limit: float, numerics: Numerics = Numerics()) -> None:
        super().__init__(gate, up, down, numerics)
        self.limit = limit

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        limit = self.limit
        return self.down(F.silu(self.gate(x).clamp(max=limit)) * self.up(x).clamp(min=-limit, max=limit))

    def why_not_stacked(self) -> str | None:
        return "a clamped SwiGLU"


class MhcDecoderLayer(DecoderLayer):
    def __init__(self, attn: TokenMixer, mlp: MLP, input_norm: torch.Tensor, post_norm: torch.Tensor, eps: float,
                 attn_mix: MhcMix, mlp_mix: MhcMix) -> None:
        super().__init__(attn, mlp, input_norm, post_norm, eps)
        self.attn_mix, self.mlp_mix = attn_mix, mlp_mix

    def __call__(self, h: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        x, post, comb = self.attn_mix.read(h)
        h = MhcMix.add(h, self.attn(rms_norm_fp32_scale(x, self.input_norm, self.eps), batch, kv), post, comb)
        x, post, comb = self.mlp_mix.read(h)
        out = self.mlp(rms_norm_fp32_scale(x, self.post_norm, self.eps), batch.token_ids)  # type: ignore[call-arg]
        return MhcMix.add(h, out, post, comb)

    def why_not_stacked(self) -> str | None:
        return "manifold-constrained hyper-connections (the fused decode step keeps one residual stream)"

    def add_to_stack(self, stack: Any, kv: PagedKVCache) -> None:
        raise NotImplementedError("why_not_stacked: never stacked")


class MhcLayers(LayerPass):
    """The layer pass of a model with manifold-constrained hyper-connections (its layers choose their ops)."""

    def __init__(self, layers: list[DecoderLayer], head: MhcHead, final_norm: torch.Tensor, streams: int,
                 eps: float) -> None:
        self.layers, self.head, self.final_norm, self.streams, self.eps = layers, head, final_norm, streams, eps

    def run(self, h: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        h = h.unsqueeze(1).expand(-1, self.streams, -1).contiguous()
        for layer in self.layers:
            h = layer(h, batch, kv)
        return rms_norm_fp32_scale(self.head(h[batch.last_token_index()]), self.final_norm, self.eps)
