"""OLMoE: q/k RMSNorm over the whole projection (before splitting into heads), optional clip_qkv."""

from __future__ import annotations

from typing import Any

from moeserve.models.registry import Architecture, register
from moeserve.models.spec import ConfigReader, ModelSpec, MoeSpec, base_attention, read_rope


@register
class Olmoe(Architecture):
    name = "OlmoeForCausalLM"

    def spec(self, config: dict[str, Any], where: str) -> ModelSpec:
        c = ConfigReader(config, where)
        num_layers = c.int("num_hidden_layers")
        bias = c.bool("attention_bias", default=False)
        clip = c.optional_float("clip_qkv")
        return ModelSpec(
            architecture=self.name,
            model_type=str(c.get("model_type", default="olmoe")),
            hidden_size=c.int("hidden_size"),
            num_layers=num_layers,
            vocab_size=c.int("vocab_size"),
            rms_norm_eps=c.float("rms_norm_eps", default=1e-5),
            max_position_embeddings=c.int("max_position_embeddings", default=4096),
            tie_word_embeddings=c.bool("tie_word_embeddings", default=False),
            dense_intermediate_size=c.int("intermediate_size"),
            moe_layers=tuple(True for _ in range(num_layers)),
            attention=base_attention(c, num_layers, qkv_bias=bias, o_bias=bias, qk_norm="full",
                                     clip_qkv=clip),
            rope=read_rope(c),
            moe=MoeSpec(
                num_experts=c.int("num_experts", "num_local_experts"),
                top_k=c.int("num_experts_per_tok"),
                intermediate_size=c.int("intermediate_size"),
                norm_topk_prob=c.bool("norm_topk_prob", default=False),
                routing="softmax_topk",
                router_bias=False,
                weights_in_fp32=False,
                expert_kind="swiglu",
                shared_intermediate_size=0,
            ),
            config_dtype=c.optional_str("dtype", "torch_dtype"),
        )
