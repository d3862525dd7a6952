"""Qwen3-MoE (q/k RMSNorm per head, dense layers by mlp_only_layers / decoder_sparse_step) and
Qwen2-MoE (qkv bias, a shared expert scaled by a sigmoid gate)."""

from __future__ import annotations

from typing import Any

from moeserve.errors import UnsupportedModelError
from moeserve.models.archs.family import read_spec, softmax_topk_moe
from moeserve.models.registry import Architecture, register
from moeserve.models.spec import ConfigReader, ModelSpec, base_attention, moe_layer_pattern, read_rope


def _qwen_spec(name: str, config: dict[str, Any], where: str, *, qwen3: bool) -> ModelSpec:
    c = ConfigReader(config, where)
    if c.bool("use_sliding_window", default=False):
        # Released Qwen MoE checkpoints never set it; refusing beats silently attending over the full context.
        raise UnsupportedModelError(f"{where}: use_sliding_window=true is not supported for {name}")
    num_layers = c.int("num_hidden_layers")
    num_experts = c.int("num_experts", "num_local_experts")
    if qwen3:
        attention = base_attention(c, num_layers, qkv_bias=c.bool("attention_bias", default=False),
                                   o_bias=c.bool("attention_bias", default=False), qk_norm="per_head")
    else:
        attention = base_attention(c, num_layers, qkv_bias=c.bool("qkv_bias", default=True))
    return read_spec(
        name, c, num_layers,
        dense_intermediate_size=c.int("intermediate_size"),
        moe_layers=moe_layer_pattern(c, num_layers, num_experts),
        attention=attention,
        rope=read_rope(c),
        moe=softmax_topk_moe(c, num_experts, norm_topk_prob=c.bool("norm_topk_prob", default=qwen3),
                             shared_intermediate_size=0 if qwen3 else c.int("shared_expert_intermediate_size",
                                                                            default=0)),
    )


@register
class Qwen3Moe(Architecture):
    name = "Qwen3MoeForCausalLM"

    def spec(self, config: dict[str, Any], where: str) -> ModelSpec:
        return _qwen_spec(self.name, config, where, qwen3=True)


@register
class Qwen2Moe(Architecture):
    name = "Qwen2MoeForCausalLM"

    def spec(self, config: dict[str, Any], where: str) -> ModelSpec:
        return _qwen_spec(self.name, config, where, qwen3=False)
