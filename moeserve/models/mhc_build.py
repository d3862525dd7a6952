"""Building a DeepSeek-V4 model's parts from its checkpoint (ModelSpec.compressed, .mhc): the rotary tables of its
attention, the hyper-connections of each layer and before the head, the decoder layers and their pass. The layers
are models/layers/mhc_layer.py, the mixer models/mixers/compressed_mixer.py."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moeserve.models.layers.mhc import MhcHead, MhcMix
from moeserve.models.layers.mhc_layer import MhcDecoderLayer, MhcLayers
from moeserve.models.mixers.compressed_mixer import Ropes
from moeserve.models.mixers.compressor import RopeTable

if TYPE_CHECKING:
    from moeserve.models.layers.base import MLP, DecoderLayer, TokenMixer
    from moeserve.models.loader import WeightLoader
    from moeserve.models.model import ModelOptions
    from moeserve.models.registry import Architecture
    from moeserve.models.spec import ModelSpec


def compressed_ropes(spec: ModelSpec, max_len: int, device: torch.device) -> Ropes:
    ca = spec.compressed
    assert ca is not None
    dims = spec.rope.rotary_dim(spec.attention.head_dim)
    return Ropes(RopeTable(spec.rope, dims, max_len, device), RopeTable(ca.compress_rope, dims, max_len, device))


def _mix(load: WeightLoader, spec: ModelSpec, prefix: str, opts: ModelOptions) -> MhcMix:
    hc = spec.mhc
    assert hc is not None
    rows, width = (2 + hc.streams) * hc.streams, hc.streams * spec.hidden_size
    f32 = torch.float32
    return MhcMix(load.tensor(prefix + "_fn", (rows, width), f32), load.tensor(prefix + "_base", (rows,), f32),
                  load.tensor(prefix + "_scale", (3,), f32), hc.streams, hc.sinkhorn_iters, hc.eps, spec.rms_norm_eps,
                  opts.numerics)


def mhc_layer(load: WeightLoader, arch: Architecture, spec: ModelSpec, L: int, attn: TokenMixer, mlp: MLP,
              opts: ModelOptions) -> MhcDecoderLayer:
    names, h = arch.names, spec.hidden_size
    norms = (load.tensor(names.input_norm.format(L=L), (h,), torch.float32),
             load.tensor(names.post_norm.format(L=L), (h,), torch.float32))
    return MhcDecoderLayer(attn, mlp, norms[0], norms[1], spec.rms_norm_eps,
                           _mix(load, spec, names.mhc_attn.format(L=L), opts),
                           _mix(load, spec, names.mhc_mlp.format(L=L), opts))


def mhc_pass(load: WeightLoader, arch: Architecture, spec: ModelSpec, layers: list[DecoderLayer],
             opts: ModelOptions) -> MhcLayers:
    hc, names = spec.mhc, arch.names
    assert hc is not None
    f32, width = torch.float32, hc.streams * spec.hidden_size
    head = MhcHead(load.tensor(names.mhc_head + "_fn", (hc.streams, width), f32),
                   load.tensor(names.mhc_head + "_base", (hc.streams,), f32),
                   load.tensor(names.mhc_head + "_scale", (1,), f32), hc.eps, spec.rms_norm_eps, opts.numerics)
    final_norm = load.tensor(names.final_norm, (spec.hidden_size,), f32)
    return MhcLayers(layers, head, final_norm, hc.streams, spec.rms_norm_eps)
