"""Mixtral: experts under `block_sparse_moe` named w1 (gate), w3 (up), w2 (down); top-k always renormalised,
routing weights kept in fp32 when they scale expert outputs (as transformers does)."""

from __future__ import annotations

from typing import Any

from moeserve.models.registry import Architecture, WeightNames, register
from moeserve.models.spec import ConfigReader, ModelSpec, MoeSpec, base_attention, read_rope


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
        return ModelSpec(
            architecture=self.name,
            model_type=str(c.get("model_type", default="mixtral")),
            hidden_size=c.int("hidden_size"),
            num_layers=num_layers,
            vocab_size=c.int("vocab_size"),
            rms_norm_eps=c.float("rms_norm_eps", default=1e-5),
            max_position_embeddings=c.int("max_position_embeddings", default=32768),
            tie_word_embeddings=c.bool("tie_word_embeddings", default=False),
            dense_intermediate_size=c.int("intermediate_size"),
            moe_layers=tuple(True for _ in range(num_layers)),
            attention=base_attention(c, num_layers, use_window=True),
            rope=read_rope(c),
            moe=MoeSpec(
                num_experts=num_experts,
                top_k=c.int("num_experts_per_tok"),
                intermediate_size=c.int("intermediate_size"),
                norm_topk_prob=True,
                routing="softmax_topk",
                router_bias=False,
                weights_in_fp32=True,
                expert_kind="swiglu",
                shared_intermediate_size=0,
            ),
            config_dtype=c.optional_str("dtype", "torch_dtype"),
        )
