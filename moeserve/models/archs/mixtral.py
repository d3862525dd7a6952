"""Mixtral: experts under `block_sparse_moe` named w1 (gate), w3 (up), w2 (down); top-k always renormalised,
routing weights kept in fp32 when they scale expert outputs (as transformers does)."""

from __future__ import annotations

from typing import Any

from moeserve.models.archs.family import read_spec, softmax_topk_moe
from moeserve.models.registry import Architecture, WeightNames, register
from moeserve.models.spec import ConfigReader, ModelSpec, base_attention, read_rope


@register
class Mixtral(Architecture):
    name = "MixtralForCausalLM"
    names = WeightNames(
        router="model.layers.{L}.block_sparse_moe.gate",
        expert_gate="model.layers.{L}.block_sparse_moe.experts.{E}.w1",
        expert_up="model.layers.{L}.block_sparse_moe.experts.{E}.w3",
        expert_down="model.layers.{L}.block_sparse_moe.experts.{E}.w2",
    )

    def spec(self, config: dict[str, Any], where: str) -> ModelSpec:
        c = ConfigReader(config, where)
        num_layers = c.int("num_hidden_layers")
        num_experts = c.int("num_local_experts", "num_experts")
        return read_spec(
            self.name, c, num_layers, model_type="mixtral", rms_norm_eps=1e-5,
            dense_intermediate_size=c.int("intermediate_size"),
            moe_layers=tuple(True for _ in range(num_layers)),
            attention=base_attention(c, num_layers, use_window=True),
            rope=read_rope(c),
            moe=softmax_topk_moe(c, num_experts, norm_topk_prob=True, intermediate_key="intermediate_size",
                                 weights_in_fp32=True),
        )
