"""Weights every layer builder reads alike (models/model.py, models/hyper_build.py, the mixers' builders): a norm
weight in the dtype and with the offset its style keeps, and the stacked q/k/v(/gate) Linear of an attention."""

from __future__ import annotations

import torch

from moeserve.models.layers.base import NORM_OFFSETS, RMS_NORMS
from moeserve.models.layers.linear import Linear
from moeserve.models.loader import WeightLoader
from moeserve.models.registry import WeightNames
from moeserve.models.spec import AttentionSpec, ModelSpec


def norm_weight(load: WeightLoader, name: str, spec: ModelSpec, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """A norm weight in the dtype its style keeps it in, with its style's offset (zero-centred: 1 + w) added once."""
    weight = load.tensor(name, shape or (spec.hidden_size,), RMS_NORMS[spec.norm_style][1])
    offset = NORM_OFFSETS.get(spec.norm_style)
    return weight.add_(offset) if offset else weight


def qkv_linear(load: WeightLoader, names: WeightNames, a: AttentionSpec, L: int, h: int) -> Linear:
    """q, k, v stacked into one Linear; with an output gate, q_proj's rows [heads, (query, gate), d] are split and
    the gates stacked last: [q, k, v, gate]."""
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    parts = [(names.q_proj.format(L=L), q), (names.k_proj.format(L=L), kv)]
    parts += [] if a.k_eq_v else [(names.v_proj.format(L=L), kv)]  # keys as values: no v_proj
    if not a.output_gate:
        return load.stacked_linear(parts, h, a.qkv_bias)
    query_gate = load.linear_weight(parts[0][0], 2 * q, h).view(a.num_heads, 2, a.head_dim, h)
    weight = torch.cat([query_gate[:, 0].reshape(q, h)] + [load.linear_weight(p, r, h) for p, r in parts[1:]]
                       + [query_gate[:, 1].reshape(q, h)])
    bias = None
    if a.qkv_bias:
        qb = load.tensor(parts[0][0] + ".bias", (2 * q,)).view(a.num_heads, 2, a.head_dim)
        bias = torch.cat([qb[:, 0].reshape(q)] + [load.tensor(p + ".bias", (r,)) for p, r in parts[1:]]
                         + [qb[:, 1].reshape(q)])
    return load.make_linear(weight, bias)
