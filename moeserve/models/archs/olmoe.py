"""OLMoE: q/k RMSNorm over the whole projection (before splitting into heads), optional clip_qkv."""

from __future__ import annotations

from typing import Any

from moeserve.models.archs.family import read_spec, softmax_topk_moe
from moeserve.models.registry import Architecture, register
from moeserve.models.spec import ConfigReader, ModelSpec, base_attention, read_rope


@register
class Olmoe(Architecture):
    name = "OlmoeForCausalLM"

    def spec(self, config: dict[str, Any], where: str) -> ModelSpec:
        c = ConfigReader(config, where)
        num_layers = c.int("num_hidden_layers")
        bias = c.bool("attention_bias", default=False)
        clip = c.optional_float("clip_qkv")
        return read_spec(
            self.name, c, num_layers, model_type="olmoe", rms_norm_eps=1e-5, max_positions=4096,
            dense_intermediate_size=c.int("intermediate_size"),
            moe_layers=tuple(True for _ in range(num_layers)),
            attention=base_attention(c, num_layers, qkv_bias=bias, o_bias=bias, qk_norm="full",
                                     clip_qkv=clip),
            rope=read_rope(c),
            moe=softmax_topk_moe(c, c.int("num_experts", "num_local_experts"),
                                 norm_topk_prob=c.bool("norm_topk_prob", default=False),
                                 intermediate_key="intermediate_size"),
        )
