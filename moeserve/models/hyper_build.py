"""Building a Qwen4-Exp model's parts from its checkpoint (ModelSpec.hyper / ngram): the gated residuals of each
layer and before the LM head, and the PLE layers, reading their n-gram tables' rows through the table store
(models/ngram_table.py). The decoder layer and the layer pass are models/layers/hyper_layer.py."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from moeserve.errors import CheckpointError
from moeserve.models.layer_weights import norm_weight
from moeserve.models.layers.hyper import GatedResidual
from moeserve.models.layers.hyper_layer import HyperDecoderLayer, PleLayer
from moeserve.models.layers.ple import PleInjection
from moeserve.models.ngram import NgramHash
from moeserve.models.validate import ngram_hash_buffers

if TYPE_CHECKING:
    from moeserve.models.layers.base import MLP, TokenMixer
    from moeserve.models.loader import WeightLoader
    from moeserve.models.model import ModelOptions
    from moeserve.models.ngram_table import NgramTable
    from moeserve.models.registry import Architecture
    from moeserve.models.spec import ModelSpec


def gated_residual(load: WeightLoader, spec: ModelSpec, prefix: str, inject: bool,
                   opts: ModelOptions) -> GatedResidual:
    hc = spec.hyper
    assert hc is not None
    width = hc.streams * spec.hidden_size
    down = load.linear(prefix + ".input_mix_weight_down", hc.rank, width, quantize=False)
    up = load.linear(prefix + ".input_mix_weight_up", width, hc.rank, quantize=False)
    weights = load.linear(prefix + ".block_inject_weight", hc.streams, width, quantize=False) if inject else None
    return GatedResidual(norm_weight(load, prefix + ".hc_norm.weight", spec, (width,)), down, up, weights, hc.streams,
                         spec.rms_norm_eps, opts.numerics)


def hyper_layer(load: WeightLoader, arch: Architecture, spec: ModelSpec, L: int, attn: TokenMixer, mlp: MLP,
                opts: ModelOptions, table: NgramTable | None = None) -> HyperDecoderLayer:
    names = arch.names
    ple = (_ple(load, arch, spec, L, opts, table) if table is not None and spec.ngram is not None
           and L in spec.ngram.layers else None)
    return HyperDecoderLayer(attn, mlp, gated_residual(load, spec, names.hc_attn.format(L=L), True, opts),
                             gated_residual(load, spec, names.hc_mlp.format(L=L), True, opts), ple)


def _ple(load: WeightLoader, arch: Architecture, spec: ModelSpec, L: int, opts: ModelOptions,
         table: NgramTable) -> PleLayer:
    ng, hc = spec.ngram, spec.hyper
    assert ng is not None and hc is not None
    index, width, prefix = ng.layers.index(L), hc.streams * spec.hidden_size, arch.names.ple.format(L=L)
    hashing = NgramHash.of(ng, spec.vocab_size, index)
    for (name, shape), ours in zip(ngram_hash_buffers(arch, spec, L),
                                   (hashing.multipliers, hashing.sizes, hashing.offsets)):
        if not torch.equal(load.tensor(name, shape, torch.int64).cpu(), ours):
            raise CheckpointError(f"{load.ckpt.path / 'config.json'}: {name} differs from the n-gram hash config.json "
                                  "gives (seed, ngram_vocab_size_base, ple_layer_ids); the config does not belong to "
                                  "these weights")
    norms = tuple(norm_weight(load, f"{prefix}.{n}.weight", spec, (width,)) for n in ("norm_key", "norm_query", "norm_conv"))
    injection = PleInjection(load.linear(prefix + ".key_proj", width, ng.embed_dim),
                             load.linear(prefix + ".value_proj", spec.hidden_size, ng.embed_dim),
                             (norms[0], norms[1], norms[2]),
                             load.tensor(prefix + ".conv1d.weight", (width, 1, ng.conv_kernel)).view(width, -1),
                             hc.streams, ng.ngram_size, spec.rms_norm_eps, opts.numerics)
    return PleLayer(hashing, functools.partial(table.lookup, L), injection, ngram_state_layer(spec, L))


def ngram_state_layer(spec: ModelSpec, L: int) -> int:
    """The layer id of PLE layer L's memory in the KV cache (engine/sizing.py spec_kv_groups: past the model's)."""
    assert spec.ngram is not None
    return spec.num_layers + spec.ngram.layers.index(L)
