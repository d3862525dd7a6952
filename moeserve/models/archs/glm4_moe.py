"""GLM-4.5 (Glm4MoeForCausalLM, model_type glm4_moe): DeepSeek-V3's "noaux_tc" routing (sigmoid scores, a
correction bias for the choice, n_group / topk_group groups, routed_scaling_factor) with GQA attention, biases on
q/k/v (not o), rotary on the first half of each head (partial_rotary_factor, 0.5 when config.json names none), an
optional per-head q/k norm, ungated shared experts (n_shared_experts x moe_intermediate_size), and dense MLPs in
the first first_k_dense_replace layers.

The published checkpoints hold num_nextn_predict_layers multi-token-prediction layers past num_hidden_layers
(model.layers.46.* in GLM-4.5-Air); greedy decoding does not use them: they are skipped at load (logged) and
count in no resident size, as transformers skips them.
"""

from __future__ import annotations

from typing import Any

from moeserve.errors import UnsupportedModelError
from moeserve.models.archs.family import read_spec
from moeserve.models.registry import Architecture, WeightNames, register
from moeserve.models.spec import ConfigReader, ModelSpec, MoeSpec, base_attention, read_rope

# transformers' Glm4MoeConfig sets partial_rotary_factor to 0.5 when config.json does not name it.
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5

# The names of the DeepSeek-V3 family (GLM-4.5 too): shared experts under mlp.shared_experts
SHARED_EXPERTS_NAMES = WeightNames(
    shared_gate="model.layers.{L}.mlp.shared_experts.gate_proj",
    shared_up="model.layers.{L}.mlp.shared_experts.up_proj",
    shared_down="model.layers.{L}.mlp.shared_experts.down_proj",
)


def require(c: ConfigReader, name: str, **supported: str) -> None:
    """Each config.json field of `supported` absent or equal to its one supported value; else one line naming it."""
    for key, value in supported.items():
        got = c.get(key, default=value)
        if got != value:
            raise UnsupportedModelError(f"{c.where}: {key}={got!r} is not supported for {name} ({value})")


@register
class Glm4Moe(Architecture):
    name = "Glm4MoeForCausalLM"
    names = SHARED_EXPERTS_NAMES

    def spec(self, config: dict[str, Any], where: str) -> ModelSpec:
        c = ConfigReader(config, where)
        require(c, self.name, hidden_act="silu")
        num_layers = c.int("num_hidden_layers")
        first_dense = c.int("first_k_dense_replace", default=1)
        bias = c.bool("attention_bias", default=False)
        qk_norm = "per_head" if c.bool("use_qk_norm", default=False) else "none"
        rope_config = config
        if "partial_rotary_factor" not in config and "partial_rotary_factor" not in (
                config.get("rope_parameters") or {}):
            rope_config = {**config, "partial_rotary_factor": DEFAULT_PARTIAL_ROTARY_FACTOR}
        return read_spec(
            self.name, c, num_layers, model_type="glm4_moe", rms_norm_eps=1e-5, max_positions=131072,
            dense_intermediate_size=c.int("intermediate_size"),
            moe_layers=tuple(i >= first_dense for i in range(num_layers)),
            attention=base_attention(c, num_layers, qkv_bias=bias, o_bias=False, qk_norm=qk_norm),
            rope=read_rope(ConfigReader(rope_config, where)),
            moe=noaux_tc_moe(c, groups=(1, 1), routed_scaling_factor=1.0),
            skipped_layers=c.int("num_nextn_predict_layers", default=0),
        )


def noaux_tc_moe(c: ConfigReader, groups: tuple[int, int], routed_scaling_factor: float) -> MoeSpec:
    """The MoE of DeepSeek-V3's family (GLM-4.5 too): noaux_tc routing with an fp32 router and correction bias, SwiGLU
    experts, ungated shared experts of n_shared_experts x moe_intermediate_size. `groups`: the defaults of
    (n_group, topk_group) and `routed_scaling_factor` that of its scale, when config.json names none (each family's
    transformers config defaults differ)."""
    moe_width = c.int("moe_intermediate_size")
    return MoeSpec(
        num_experts=c.int("n_routed_experts", "num_local_experts"),
        top_k=c.int("num_experts_per_tok"),
        intermediate_size=moe_width,
        norm_topk_prob=c.bool("norm_topk_prob", default=True),
        routing="sigmoid_groups",
        router_bias=False,
        weights_in_fp32=True,  # transformers' fp32 router weights scale the expert outputs in fp32
        expert_kind="swiglu",
        shared_intermediate_size=c.int("n_shared_experts", default=1) * moe_width,
        shared_gated=False,
        router_fp32=True,
        n_group=c.int("n_group", default=groups[0]),
        topk_group=c.int("topk_group", default=groups[1]),
        routed_scaling_factor=c.float("routed_scaling_factor", default=routed_scaling_factor),
        correction_bias=True,
    )
