"""Gemma-4's decoder layer (ModelSpec.sandwich): every part normed before and after, a dense MLP beside the MoE.

    h = h + post_attn(attn(input(h)))
    m = post_dense(dense(pre_mlp(h))) + post_moe(moe(h))     # MoE layer: router on h, experts on pre_moe(h)
    m = mlp(pre_mlp(h))                                      # dense layer
    h = (h + post_mlp(m)) * layer_scalar

operation for operation as transformers' Gemma4TextDecoderLayer (the MoE block applies pre_moe itself:
MoEBlock's expert norm). The residual adds are not fused into the norms (passes.CppLayers fuses a plain
DecoderLayer's), so the model runs these layers through passes.TorchLayers, each layer's own `__call__`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from moeserve.models.layers.base import MLP, DecoderLayer, DenseMLP, ForwardBatch, TokenMixer
from moeserve.state.kv_cache import PagedKVCache


class GeGLUMLP(DenseMLP):
    """down(gelu_tanh(gate(x)) * up(x)) (transformers' gelu_pytorch_tanh); row blocks as DenseMLP when
    batch-invariant. No decode-stack form."""

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.gate(x), approximate="tanh") * self.up(x))

    def why_not_stacked(self) -> str | None:
        return "a GeGLU MLP (no decode-stack form)"


@dataclass(frozen=True)
class SandwichNorms:
    """A sandwich layer's norm weights [H] (and its output scale [1])."""

    input: torch.Tensor
    post_attn: torch.Tensor
    pre_mlp: torch.Tensor
    post_mlp: torch.Tensor
    post_dense: torch.Tensor | None  # MoE layers: after the dense MLP beside the experts
    post_moe: torch.Tensor | None  # MoE layers: after the experts
    scalar: torch.Tensor  # [1] in the compute dtype


class SandwichLayer(DecoderLayer):
    fuses_norms = False

    def __init__(self, attn: TokenMixer, mlp: MLP, dense: MLP | None, norms: SandwichNorms, eps: float,
                 norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]) -> None:
        """`mlp`: the MoE block (its experts read pre_moe(h): MoEBlock's expert norm), or the dense MLP of a dense
        layer; `dense`: in a MoE layer, the dense MLP beside it (None in a dense layer)."""
        super().__init__(attn, mlp, norms.input, norms.pre_mlp, eps, norm)
        self.dense, self.norms = dense, norms

    def __call__(self, h: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        norm, eps, w = self.norm, self.eps, self.norms
        h = h + norm(self.attn(norm(h, w.input, eps), batch, kv), w.post_attn, eps)
        if self.dense is None:
            m = self.mlp(norm(h, w.pre_mlp, eps))
        else:
            assert w.post_dense is not None and w.post_moe is not None
            m = norm(self.dense(norm(h, w.pre_mlp, eps)), w.post_dense, eps) + norm(self.mlp(h), w.post_moe, eps)
        return (h + norm(m, w.post_mlp, eps)) * w.scalar

    def why_not_stacked(self) -> str | None:
        return "sandwich layers (norms after each part, a dense MLP beside the MoE: Gemma-4) have no decode-stack form"

    def add_to_stack(self, stack: Any, kv: PagedKVCache) -> None:
        raise AssertionError("why_not_stacked() refuses sandwich layers")
