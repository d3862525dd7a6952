"""Gemma-4's MoE text model (transformers' gemma4: Gemma4ForCausalLM, model_type gemma4_text; and the language model
of Gemma4ForConditionalGeneration, model_type gemma4, under `model.language_model.*`).

- Layers (SandwichSpec, models/layers/sandwich.py): each part normed before and after; a dense GeGLU MLP beside the
  MoE in every layer (enable_moe_block), their outputs normed apart and summed; the router reads the residual
  (normalised without weight, times router.scale / sqrt(hidden)), the experts its pre_feedforward_layernorm_2;
  softmax top-k renormalised, times router.per_expert_scale (routing "normed_softmax_topk"); the layer's output
  times its layer_scalar. Norms scale in fp32 by the weight as stored (not 1 + w).
- Experts: GeGLU (tanh GELU), every expert of a layer in one tensor per projection, experts.gate_up_proj [E, 2I, H]
  (gate rows first) and experts.down_proj [E, H, I] (expert kind "geglu").
- Attention: per-head q/k norms, values RMS-normed without weight, softmax scale 1; sliding-window layers
  (layer_types; 5 of every 6 by default) of head_dim with the default rotary; the full-attention ("global")
  layers wider (global_head_dim, or per_layer_config's head_dim as transformers 5.24 writes it) with their own
  KV heads (num_global_key_value_heads), keys as values when attention_k_eq_v (no v_proj), and proportional
  rotary (rope_parameters per layer type): an AttentionOverride, its KV group holding its own head shape.
- The embedding times sqrt(hidden) (cast to the compute dtype first), logits soft-capped (final_logit_softcapping).

Not served, refused in one line: per-layer input embeddings (hidden_size_per_layer_input > 0: the small Gemma-4
models), KV sharing across layers (num_kv_shared_layers), bidirectional attention, dense-only configs (no MoE).
The multimodal wrapper's vision and audio towers and their embedders are not loaded (logged): text input only.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from moeserve.errors import CheckpointError, UnsupportedModelError
from moeserve.models.archs.family import read_spec
from moeserve.models.archs.qwen3_next import language_model_names
from moeserve.models.registry import Architecture, WeightNames, register
from moeserve.models.spec import (
    AttentionOverride,
    ConfigReader,
    ModelSpec,
    MoeSpec,
    SandwichSpec,
    base_attention,
    check_int,
    read_rope,
)

SLIDING, FULL = "sliding_attention", "full_attention"
_NAMES = dict(
    post_norm="model.layers.{L}.post_attention_layernorm.weight",
    router="model.layers.{L}.router.proj",
    router_scale="model.layers.{L}.router.scale",
    router_expert_scale="model.layers.{L}.router.per_expert_scale",
    stacked_gate_up="model.layers.{L}.experts.gate_up_proj",
    stacked_down="model.layers.{L}.experts.down_proj",
)
TOWERS = "the vision and audio towers and their embedders: text input only"


def layer_types(c: ConfigReader, num_layers: int) -> list[str]:
    """config.json's layer_types, else transformers' default (every 6th layer full); the last layer is always full
    attention (transformers forces it)."""
    types = c.get("layer_types", default=None)
    if types is None:
        types = [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers or not set(types) <= {SLIDING, FULL}:
        raise CheckpointError(f"{c.where}: 'layer_types' must list '{SLIDING}' or '{FULL}' for each of the "
                              f"{num_layers} layers")
    return [*types[:-1], FULL]


def _rope(c: ConfigReader, kind: str, default: dict[str, Any]) -> Any:
    params = c.get("rope_parameters", default=None) or {}
    if not isinstance(params, dict) or not isinstance(params.get(kind, default), dict):
        raise CheckpointError(f"{c.where}: 'rope_parameters' must hold an object per layer type ({SLIDING}, {FULL})")
    return read_rope(ConfigReader({"rope_parameters": params.get(kind, default)}, c.where))


def _global_shape(c: ConfigReader, types: list[str]) -> tuple[int, int | None]:
    """(head_dim, KV heads or None for the sliding layers') of the full-attention layers: per_layer_config (as
    transformers 5.24 writes config.json: one entry per full layer), else global_head_dim / num_global_key_value_heads
    (transformers' keywords, default 512 / the sliding layers' when keys are not values)."""
    per_layer = c.get("per_layer_config", default=None)
    full = [i for i, t in enumerate(types) if t == FULL]
    if per_layer is None:
        heads = c.optional_int("num_global_key_value_heads") if c.bool("attention_k_eq_v", default=False) else None
        return c.int("global_head_dim", default=512), heads
    if not isinstance(per_layer, dict):
        raise CheckpointError(f"{c.where}: 'per_layer_config' must be an object of layer overrides")
    entries = [per_layer.get(str(i)) for i in full]  # JSON keys are strings
    first: dict[str, Any] = entries[0] if entries and isinstance(entries[0], dict) else {}
    if any(e != first for e in entries):
        raise UnsupportedModelError(f"{c.where}: 'per_layer_config' must give every full-attention layer the same "
                                    "overrides (one head shape per layer type)")
    if set(first) - {"head_dim", "num_key_value_heads"} or set(per_layer) - {str(i) for i in full}:
        raise UnsupportedModelError(f"{c.where}: 'per_layer_config' overrides only head_dim and num_key_value_heads "
                                    "of the full-attention layers here")
    heads = first.get("num_key_value_heads")
    return (check_int(first.get("head_dim", c.int("head_dim", default=256)), "head_dim", c.where),
            None if heads is None else check_int(heads, "num_key_value_heads", c.where))


def _refuse_unserved(c: ConfigReader, name: str) -> None:
    """One line for the Gemma-4 variants this family does not serve."""
    if c.int("hidden_size_per_layer_input", default=256):
        raise UnsupportedModelError(f"{c.where}: hidden_size_per_layer_input > 0 (per-layer input embeddings, the "
                                    f"small Gemma-4 models) is not supported for {name}")
    if c.int("num_kv_shared_layers", default=0):
        raise UnsupportedModelError(f"{c.where}: num_kv_shared_layers > 0 (layers reusing others' keys and values) "
                                    f"is not supported for {name}")
    if c.get("use_bidirectional_attention", default=None) is not None:
        raise UnsupportedModelError(f"{c.where}: use_bidirectional_attention is not supported for {name} (causal "
                                    "text only)")
    if not c.bool("enable_moe_block", default=False):
        raise UnsupportedModelError(f"{c.where}: enable_moe_block=false (a dense Gemma-4) is not supported: moeserve "
                                    "serves mixture-of-experts models")
    if c.get("hidden_activation", default="gelu_pytorch_tanh") != "gelu_pytorch_tanh" or \
            c.bool("attention_bias", default=False) or c.bool("use_double_wide_mlp", default=False):
        raise UnsupportedModelError(f"{c.where}: hidden_activation other than gelu_pytorch_tanh, attention_bias or "
                                    f"use_double_wide_mlp is not supported for {name}")


def gemma4_spec(name: str, c: ConfigReader, dtype: str | None) -> ModelSpec:
    """The spec of Gemma-4's text config `c` (defaults: transformers 5.24's Gemma4TextConfig)."""
    _refuse_unserved(c, name)
    num_layers, hidden = c.int("num_hidden_layers"), c.int("hidden_size")
    types = layer_types(c, num_layers)
    window = c.int("sliding_window", default=512)
    windows = tuple(window if t == SLIDING else None for t in types)
    sliding = replace(base_attention(c, num_layers, qk_norm="per_head", scale=1.0, v_norm=True),
                      head_dim=c.int("head_dim", default=256), sliding_window=windows)
    head_dim, kv_heads = _global_shape(c, types)
    k_eq_v = c.bool("attention_k_eq_v", default=False)
    full = replace(sliding, head_dim=head_dim, num_kv_heads=kv_heads or sliding.num_kv_heads, k_eq_v=k_eq_v)
    override = AttentionOverride(
        layers=tuple(i for i, t in enumerate(types) if t == FULL), attention=full,
        rope=_rope(c, FULL, {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}))
    return read_spec(
        name, c, num_layers, model_type="gemma4_text", max_positions=131072, config_dtype=dtype,
        dense_intermediate_size=c.int("intermediate_size", default=9216),
        moe_layers=(True,) * num_layers,
        attention=sliding,
        rope=_rope(c, SLIDING, {"rope_type": "default", "rope_theta": 10000.0}),
        moe=MoeSpec(num_experts=c.int("num_experts"), top_k=c.int("top_k_experts"),
                    intermediate_size=c.int("moe_intermediate_size"), norm_topk_prob=True,
                    routing="normed_softmax_topk", router_bias=False, weights_in_fp32=True, expert_kind="geglu",
                    shared_intermediate_size=0, expert_scales=True),
        norm_style="scale_in_fp32",
        mlp_kind="geglu",
        attention_override=override if override.layers and full != sliding else None,
        sandwich=SandwichSpec(),
        embed_scale=hidden**0.5,
        logit_softcap=c.optional_float("final_logit_softcapping"),  # > 0 (FLOAT_BOUNDS)
    )


GEMMA4_NAMES = WeightNames(**_NAMES)


@register
class Gemma4Text(Architecture):
    name = "Gemma4ForCausalLM"
    names = GEMMA4_NAMES

    def spec(self, config: dict[str, Any], where: str) -> ModelSpec:
        c = ConfigReader({"tie_word_embeddings": True, **config}, where)
        return gemma4_spec(self.name, c, c.optional_str("dtype", "torch_dtype"))


@register
class Gemma4(Architecture):
    name = "Gemma4ForConditionalGeneration"
    names = language_model_names(GEMMA4_NAMES)
    unserved = tuple((f"model.{part}.", TOWERS) for part in ("vision_tower", "embed_vision", "audio_tower",
                                                               "embed_audio"))

    def spec(self, config: dict[str, Any], where: str) -> ModelSpec:
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise CheckpointError(f"{where}: {self.name} needs a 'text_config' object (the language model's fields)")
        c = ConfigReader({**text, "tie_word_embeddings": config.get("tie_word_embeddings", True)}, where)
        dtype = c.optional_str("dtype", "torch_dtype") or ConfigReader(config, where).optional_str("dtype",
                                                                                                    "torch_dtype")
        return gemma4_spec(self.name, c, dtype)
