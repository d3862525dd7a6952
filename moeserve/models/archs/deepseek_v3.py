"""DeepSeek-V3 and Kimi-K2 (DeepseekV3ForCausalLM; model_type deepseek_v3 or kimi_k2): multi-head latent attention
(models/mixers/mla.py) over a compressed latent cache, DeepSeek-V3's "noaux_tc" routing (sigmoid scores, a correction bias
for the choice, n_group / topk_group groups, routed_scaling_factor: moe.SigmoidGroups, as GLM-4.5), ungated shared
experts (n_shared_experts x moe_intermediate_size) and dense MLPs in the first first_k_dense_replace layers.

- Rotary: on the qk_rope_head_dim dims of each head only (transformers' config.head_dim = qk_rope_head_dim), in
  DeepSeek's interleaved pair layout unless rope_interleave is false; yarn as transformers computes it: the cos/sin
  factor mscale(factor, mscale) / mscale(factor, mscale_all_dim) (1 for the published configs) and the softmax
  scale qk_head_dim**-0.5 times mscale(factor, mscale_all_dim)**2.
- q_lora_rank null (as DeepSeek-V2-Lite): q_proj in place of q_a_proj / q_a_layernorm / q_b_proj.
- The published checkpoints hold num_nextn_predict_layers multi-token-prediction layers past num_hidden_layers
  (model.layers.61.* in DeepSeek-V3): skipped at load (logged), in no resident size, as transformers skips them.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from moeserve.errors import CheckpointError
from moeserve.models.archs.family import read_spec
from moeserve.models.archs.glm4_moe import SHARED_EXPERTS_NAMES, noaux_tc_moe, require
from moeserve.models.registry import Architecture, register
from moeserve.models.spec import (
    ConfigReader,
    MlaSpec,
    ModelSpec,
    RopeSpec,
    base_attention,
    read_rope,
)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """DeepSeek's yarn magnitude scale (transformers' get_mscale / yarn_get_mscale)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def deepseek_rope(c: ConfigReader) -> RopeSpec:
    """read_rope, with yarn's cos/sin factor made explicit (attention_factor) from mscale / mscale_all_dim as
    transformers derives it when config.json names none."""
    rope = read_rope(c)
    if rope.rope_type != "yarn" or rope.param("attention_factor") is not None:
        return rope
    factor = float(rope.param("factor"))
    mscale, mscale_all = rope.param("mscale"), rope.param("mscale_all_dim")
    attention = (yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all)) if mscale and mscale_all
                 else yarn_mscale(factor))
    params = tuple(sorted({**dict(rope.params), "attention_factor": attention}.items()))
    return RopeSpec(rope.theta, rope.rope_type, params, rope.partial_rotary_factor)


def softmax_scale(qk_head_dim: int, rope: RopeSpec) -> float:
    """qk_head_dim**-0.5, times mscale(factor, mscale_all_dim)**2 under yarn (transformers' yarn_apply_mscale)."""
    scale = qk_head_dim**-0.5
    mscale_all = rope.param("mscale_all_dim", 0) if rope.rope_type != "default" else 0
    if mscale_all:
        m = yarn_mscale(float(rope.param("factor")), float(mscale_all))
        scale = scale * m * m
    return scale


def read_mla(c: ConfigReader, rope: RopeSpec) -> MlaSpec:
    nope, rope_dim = c.int("qk_nope_head_dim"), c.int("qk_rope_head_dim")
    return MlaSpec(
        q_lora_rank=c.optional_int("q_lora_rank"),
        kv_lora_rank=c.int("kv_lora_rank"),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=c.int("v_head_dim"),
        bias=c.bool("attention_bias", default=False),
        interleaved_rope=c.bool("rope_interleave", default=True),
        softmax_scale=softmax_scale(nope + rope_dim, rope),
    )


@register
class DeepseekV3(Architecture):
    name = "DeepseekV3ForCausalLM"
    names = SHARED_EXPERTS_NAMES

    def spec(self, config: dict[str, Any], where: str) -> ModelSpec:
        return deepseek_v3_spec(self.name, config, where)


def deepseek_v3_spec(name: str, config: dict[str, Any], where: str, *, model_type: str = "deepseek_v3",
                     max_positions: int = 4096, rms_norm_eps: float = 1e-6,
                     groups: tuple[int, int] = (8, 4)) -> ModelSpec:
    """The spec of a DeepSeek-V3 text model's config.json fields (DeepseekV3ForCausalLM, Kimi-K2.5's text_config, and
    the DeepSeek Sparse Attention models built on it: deepseek_v32.py); the keywords: the family's defaults for
    fields config.json leaves out (transformers' config classes differ)."""
    c = ConfigReader(config, where)
    require(c, name, hidden_act="silu", topk_method="noaux_tc", scoring_func="sigmoid")
    num_layers = c.int("num_hidden_layers")
    rope_dim = c.int("qk_rope_head_dim")
    rope = deepseek_rope(c)
    return read_spec(
        name, c, num_layers, model_type=model_type, max_positions=max_positions, rms_norm_eps=rms_norm_eps,
        dense_intermediate_size=c.int("intermediate_size"),
        moe_layers=moe_layers(c, num_layers),
        # the rotary part of each head is what the shared Rotary tables are built for (head_dim = rope dims)
        attention=replace(base_attention(c, num_layers), head_dim=rope_dim),
        rope=rope,
        moe=noaux_tc_moe(c, groups=groups, routed_scaling_factor=2.5),  # transformers' defaults
        skipped_layers=c.int("num_nextn_predict_layers", "num_mtp_layers", default=0),
        mla=read_mla(c, rope),
    )


def moe_layers(c: ConfigReader, num_layers: int) -> tuple[bool, ...]:
    """Per layer, whether it is a MoE layer: config.json's mlp_layer_types ("dense" / "sparse", as transformers writes
    it for DeepSeek-V3.2 and GLM-5) when present, else all but the first first_k_dense_replace."""
    types = c.get("mlp_layer_types", default=None)
    if types is None:
        first_dense = c.int("first_k_dense_replace", default=3)
        return tuple(i >= first_dense for i in range(num_layers))
    if not isinstance(types, list) or len(types) != num_layers or not set(types) <= {"dense", "sparse"}:
        raise CheckpointError(f"{c.where}: 'mlp_layer_types' must list 'dense' or 'sparse' for each of the "
                              f"{num_layers} layers")
    return tuple(t == "sparse" for t in types)
