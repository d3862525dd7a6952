"""MiniMax-M2 (MiniMaxM2ForCausalLM, model_type minimax_m2): GQA attention with one RMSNorm over all query heads and
one over all key heads (qk_norm "full", before the split into heads, as OLMoE), rotary on the first rotary_dim dims
of each head (partial_rotary_factor = rotary_dim / head_dim when config.json names no factor), and a MoE in every
layer: Mixtral's expert names (block_sparse_moe.experts.{E}.w1 / w3 / w2), sigmoid scores with a per-expert
correction bias for the choice (e_score_correction_bias), the top-k unbiased scores renormalised: noaux_tc with one
group and no scale (moe.SigmoidGroups). Unlike DeepSeek-V3 the router is held in the compute dtype (transformers'
MiniMaxM2TopKRouter computes its logits so), its scores in fp32.

The published checkpoint is FP8 with 128 x 128 block scales (quantization_config quant_method fp8,
weight_block_size; formats/fp8_block.py): experts stay FP8 in every tier, dense Linears are dequantized at load.
Its num_mtp_modules multi-token-prediction modules (not in transformers' class) sit past num_hidden_layers
(model.layers.62.* on, as vLLM and SGLang read them): skipped at load (logged), in no resident size; greedy decoding
does not use them.
"""

from __future__ import annotations

from typing import Any

from moeserve.errors import UnsupportedModelError
from moeserve.models.archs.family import read_spec
from moeserve.models.archs.glm4_moe import require
from moeserve.models.registry import Architecture, WeightNames, register
from moeserve.models.spec import ConfigReader, ModelSpec, MoeSpec, base_attention, check_float, read_rope


def rope_config(config: dict[str, Any], where: str) -> dict[str, Any]:
    """config.json with partial_rotary_factor = rotary_dim / head_dim when it names rotary_dim and no factor (as
    transformers' MiniMaxM2Config derives it)."""
    rope = config.get("rope_parameters") or {}
    if "rotary_dim" not in config or "partial_rotary_factor" in config or "partial_rotary_factor" in rope:
        return config
    c = ConfigReader(config, where)
    head_dim = c.int("head_dim", default=c.int("hidden_size") // c.int("num_attention_heads"))
    factor = check_float(c.int("rotary_dim") / head_dim, "partial_rotary_factor", where)
    return {**config, "partial_rotary_factor": factor}


@register
class MiniMaxM2(Architecture):
    name = "MiniMaxM2ForCausalLM"
    names = WeightNames(
        router="model.layers.{L}.block_sparse_moe.gate",
        router_correction_bias="model.layers.{L}.block_sparse_moe.e_score_correction_bias",
        expert_gate="model.layers.{L}.block_sparse_moe.experts.{E}.w1",
        expert_up="model.layers.{L}.block_sparse_moe.experts.{E}.w3",
        expert_down="model.layers.{L}.block_sparse_moe.experts.{E}.w2",
    )

    def spec(self, config: dict[str, Any], where: str) -> ModelSpec:
        c = ConfigReader(config, where)
        require(c, self.name, hidden_act="silu", scoring_func="sigmoid", qk_norm_type="per_layer")
        for key in ("use_qk_norm", "use_routing_bias"):
            if not c.bool(key, default=True):
                raise UnsupportedModelError(f"{where}: {key}=false is not supported for {self.name} (true)")
        num_layers = c.int("num_hidden_layers")
        return read_spec(
            self.name, c, num_layers, model_type="minimax_m2", max_positions=196608,
            dense_intermediate_size=0,
            moe_layers=(True,) * num_layers,
            attention=base_attention(c, num_layers, qk_norm="full"),
            rope=read_rope(ConfigReader(rope_config(config, where), where)),
            moe=MoeSpec(
                num_experts=c.int("num_local_experts", "num_experts"),
                top_k=c.int("num_experts_per_tok"),
                intermediate_size=c.int("intermediate_size"),
                norm_topk_prob=True,
                routing="sigmoid_groups",  # one group, no scale: sigmoid, biased choice, renormalised top-k
                router_bias=False,
                weights_in_fp32=True,
                expert_kind="swiglu",
                shared_intermediate_size=0,
                correction_bias=True,
            ),
            skipped_layers=c.int("num_mtp_modules", default=0),
        )
