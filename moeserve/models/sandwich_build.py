"""Building a sandwich model's parts from its checkpoint (ModelSpec.sandwich: Gemma-4): the layer's norms and output
scale, the experts' own input norm and the scaled router (MoeSpec.expert_scales). The layer is
models/layers/sandwich.py; the routing rule models/experts/moe.py NormedSoftmaxTopk."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from moeserve.models.experts.moe import NormedSoftmaxTopk
from moeserve.models.layer_weights import norm_weight
from moeserve.models.layers.base import RMS_NORMS, rms_norm_fp32_scale
from moeserve.models.layers.sandwich import SandwichLayer, SandwichNorms

if TYPE_CHECKING:
    from moeserve.models.layers.base import MLP, TokenMixer
    from moeserve.models.loader import WeightLoader
    from moeserve.models.registry import Architecture
    from moeserve.models.spec import ModelSpec


def sandwich_layer(load: WeightLoader, arch: Architecture, spec: ModelSpec, L: int, attn: TokenMixer, mlp: MLP,
                   dense: MLP | None) -> SandwichLayer:
    """Layer L: `mlp` the MoE block (with `dense` beside it) or, in a dense layer, the dense MLP (`dense` None)."""
    names = arch.names

    def norm(template: str) -> torch.Tensor:
        return norm_weight(load, template.format(L=L), spec)

    norms = SandwichNorms(
        input=norm(names.input_norm), post_attn=norm(names.post_norm), pre_mlp=norm(names.pre_mlp_norm),
        post_mlp=norm(names.post_mlp_norm),
        post_dense=norm(names.post_dense_norm) if dense is not None else None,
        post_moe=norm(names.post_moe_norm) if dense is not None else None,
        scalar=load.tensor(names.layer_scalar.format(L=L), (1,)))
    return SandwichLayer(attn, mlp, dense, norms, spec.rms_norm_eps, RMS_NORMS[spec.norm_style][0])


def sandwich_expert_norm(load: WeightLoader, arch: Architecture, spec: ModelSpec,
                         L: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The experts' input norm of MoE layer L (pre_feedforward_layernorm_2 of the residual the router reads), or None
    for a model without sandwich layers."""
    if spec.sandwich is None:
        return None
    weight, norm, eps = norm_weight(load, arch.names.pre_moe_norm.format(L=L), spec), RMS_NORMS[spec.norm_style][0], \
        spec.rms_norm_eps
    return lambda x: norm(x, weight, eps)


def scaled_router(load: WeightLoader, arch: Architecture, spec: ModelSpec, L: int) -> NormedSoftmaxTopk | None:
    """MoE layer L's normed_softmax_topk routing with its router input scale [H] and per-expert scales [E] (in the
    compute dtype, as transformers holds them), or None for another rule."""
    if not spec.moe.expert_scales:
        return None
    names, m = arch.names, spec.moe
    return NormedSoftmaxTopk(m, load.tensor(names.router_scale.format(L=L), (spec.hidden_size,)),
                             load.tensor(names.router_expert_scale.format(L=L), (m.num_experts,)),
                             spec.rms_norm_eps, rms_norm_fp32_scale)
