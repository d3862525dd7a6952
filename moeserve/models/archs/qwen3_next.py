"""Qwen3-Next (Qwen3NextForCausalLM) and Qwen3.5 / Qwen3.6 MoE (Qwen3_5MoeForConditionalGeneration, and the text-only
Qwen3_5MoeForCausalLM): hybrids of Gated
DeltaNet linear attention (models/mixers/gated_delta.py) and gated full attention, three linear layers to one full
(`layer_types`, else every `full_attention_interval`-th layer is full).

- Full attention: q_proj gives each head's query and an output gate side by side ([nh, 2, d]); the output is
  multiplied by sigmoid(gate) before o_proj; q/k RMSNorm per head; rotary on the first partial_rotary_factor of
  each head (0.25).
- Every RMSNorm (layers, final, q/k) is zero-centred: the checkpoint stores w, the scale is 1 + w in fp32.
- MoE: softmax top-k routing, a shared expert scaled by a sigmoid gate.
- Qwen3.5 checkpoints hold the language model under `model.language_model.*` beside a vision tower
  (`model.visual.*`) and multi-token-prediction layers (`mtp.*`, mtp_num_hidden_layers): the text model is served,
  the rest never read (logged at start-up); its config.json nests the text model's fields under `text_config`.
  Its multimodal rotary (mrope) equals plain rotary for text: the three position streams are equal.
- Qwen3.6 (Qwen3.6-35B-A3B) ships as this same class (model_type qwen3_5_moe, the 35B-A3B shapes): served as Qwen3.5.
- The text-only Qwen3_5MoeForCausalLM (what transformers writes for a Qwen3.5 language model alone, model_type
  qwen3_5_moe_text): the same model with flat config.json fields and flat `model.layers.*` names, mtp.* unserved.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Literal

from moeserve.errors import CheckpointError, UnsupportedModelError
from moeserve.models.archs.family import read_spec, softmax_topk_moe
from moeserve.models.registry import Architecture, WeightNames, register
from moeserve.models.spec import (
    ConfigReader,
    LinearAttentionSpec,
    ModelSpec,
    base_attention,
    moe_layer_pattern,
    read_rope,
)

LINEAR, FULL = "linear_attention", "full_attention"
MTP_REASON = "multi-token-prediction layers (mtp.*): greedy decoding does not use them"


def layer_types(c: ConfigReader, num_layers: int) -> list[str]:
    """config.json `layer_types`, else every full_attention_interval-th layer full (transformers' default)."""
    types = c.get("layer_types", default=None)
    if types is None:
        interval = c.int("full_attention_interval", default=4)
        return [FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers or any(t not in (LINEAR, FULL) for t in types):
        raise CheckpointError(f"{c.where}: 'layer_types' must list '{LINEAR}' or '{FULL}' for each of the "
                              f"{num_layers} layers")
    return types


def hybrid_spec(name: str, c: ConfigReader, projections: Literal["qkvz_ba", "qkv_z_b_a"],
                dtype: str | None) -> ModelSpec:
    act = c.get("hidden_act", default="silu")
    if act != "silu":
        raise UnsupportedModelError(f"{c.where}: hidden_act={act!r} is not supported for {name} (silu)")
    num_layers = c.int("num_hidden_layers")
    num_experts = c.int("num_experts")
    types = layer_types(c, num_layers)
    bias = c.bool("attention_bias", default=False)
    qwen35 = projections == "qkv_z_b_a"  # every Qwen3.5 layer is MoE, its top-k always renormalised
    return read_spec(
        name, c, num_layers,
        config_dtype=dtype,
        dense_intermediate_size=0 if qwen35 else c.int("intermediate_size"),
        moe_layers=(True,) * num_layers if qwen35 else moe_layer_pattern(c, num_layers, num_experts),
        attention=base_attention(c, num_layers, qkv_bias=bias, o_bias=bias, qk_norm="per_head", output_gate=True),
        rope=read_rope(c),
        moe=softmax_topk_moe(c, num_experts,
                             norm_topk_prob=True if qwen35 else c.bool("norm_topk_prob", default=True),
                             shared_intermediate_size=c.int("shared_expert_intermediate_size", default=0)),
        norm_style="zero_centered",  # MTP layers live under mtp.* (Architecture.unserved), not past the last layer
        linear_attention=LinearAttentionSpec(
            layers=tuple(i for i, t in enumerate(types) if t == LINEAR),
            num_k_heads=c.int("linear_num_key_heads"),
            num_v_heads=c.int("linear_num_value_heads"),
            k_head_dim=c.int("linear_key_head_dim"),
            v_head_dim=c.int("linear_value_head_dim"),
            conv_kernel=c.int("linear_conv_kernel_dim", default=4),
            projections=projections,
        ),
    )


@register
class Qwen3Next(Architecture):
    name = "Qwen3NextForCausalLM"
    unserved = (("mtp.", MTP_REASON),)

    def spec(self, config: dict[str, Any], where: str) -> ModelSpec:
        c = ConfigReader(config, where)
        if c.bool("use_sliding_window", default=False):
            raise UnsupportedModelError(f"{where}: use_sliding_window=true is not supported for {self.name}")
        return hybrid_spec(self.name, c, "qkvz_ba", c.optional_str("dtype", "torch_dtype"))


def language_model_names(names: WeightNames = WeightNames()) -> WeightNames:
    """`names` with every `model.` name under `model.language_model.` (the LM head stays `lm_head`)."""
    fields = asdict(names)
    return WeightNames(**{k: v.replace("model.", "model.language_model.", 1) if v.startswith("model.") else v
                          for k, v in fields.items()})


@register
class Qwen35Moe(Architecture):
    name = "Qwen3_5MoeForConditionalGeneration"
    names = language_model_names()
    unserved = (("model.visual.", "the vision tower (model.visual.*): text input only"), ("mtp.", MTP_REASON))

    def spec(self, config: dict[str, Any], where: str) -> ModelSpec:
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise CheckpointError(f"{where}: {self.name} needs a 'text_config' object (the language model's fields)")
        c = ConfigReader({"tie_word_embeddings": config.get("tie_word_embeddings", False), **text}, where)
        dtype = c.optional_str("dtype", "torch_dtype") or ConfigReader(config, where).optional_str("dtype",
                                                                                                    "torch_dtype")
        c.int("mtp_num_hidden_layers", default=0)  # bounds-checked; its layers are skipped (unserved)
        return hybrid_spec(self.name, c, "qkv_z_b_a", dtype)


@register
class Qwen35MoeText(Architecture):
    name = "Qwen3_5MoeForCausalLM"
    unserved = (("mtp.", MTP_REASON),)

    def spec(self, config: dict[str, Any], where: str) -> ModelSpec:
        c = ConfigReader(config, where)
        c.int("mtp_num_hidden_layers", default=0)  # bounds-checked; its layers are skipped (unserved)
        return hybrid_spec(self.name, c, "qkv_z_b_a", c.optional_str("dtype", "torch_dtype"))
