"""gpt-oss (GptOssForCausalLM): attention sinks, sliding window on alternate layers, YaRN rotary embedding,
biases everywhere, a router with a bias and softmax over the selected top-k, and experts stacked per layer.

Experts are stored as one tensor per projection with all experts along dim 0: in the bf16 layout
``experts.gate_up_proj [E, H, 2I]`` / ``down_proj [E, I, H]`` (input-major, used as ``x @ W``), in the MXFP4 layout
``gate_up_proj_blocks [E, 2I, H/32, 16]`` + ``_scales`` (output-major); biases ``*_bias [E, 2I]`` / ``[E, H]`` in
both. gate/up rows are INTERLEAVED (even = gate, odd = up); the activation is SwiGLU with clamp (limit 7.0,
alpha 1.702). The expert plans live in `moeserve.models.experts.plans` (expert_kind "gpt_oss").
"""

from __future__ import annotations

from typing import Any

from moeserve.errors import CheckpointError
from moeserve.models.archs.family import read_spec
from moeserve.models.registry import Architecture, WeightNames, register
from moeserve.models.spec import AttentionSpec, ConfigReader, ModelSpec, MoeSpec, read_rope

# Defaults of transformers' GptOssConfig (the released config.json files carry only some of them).
DEFAULT_SWIGLU_LIMIT = 7.0
DEFAULT_SWIGLU_ALPHA = 1.702
_LAYER_TYPES = ("sliding_attention", "full_attention")
# transformers' GptOssConfig rope when config.json names none (the released checkpoints name it).
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def sliding_windows(c: ConfigReader, num_layers: int) -> tuple[int | None, ...]:
    """Per-layer window: from `layer_types` if given, else sliding on even layers (0, 2, ...) as the reference."""
    window = c.int("sliding_window", default=128)
    layer_types = c.get("layer_types", default=None)
    if layer_types is None:
        layer_types = [_LAYER_TYPES[i % 2] for i in range(num_layers)]
    if (
        not isinstance(layer_types, list)
        or len(layer_types) != num_layers
        or any(t not in _LAYER_TYPES for t in layer_types)
    ):
        raise CheckpointError(f"{c.where}: 'layer_types' must list {num_layers} of {', '.join(_LAYER_TYPES)}")
    return tuple(window if t == "sliding_attention" else None for t in layer_types)


@register
class GptOss(Architecture):
    name = "GptOssForCausalLM"
    names = WeightNames(router="model.layers.{L}.mlp.router")

    def spec(self, config: dict[str, Any], where: str) -> ModelSpec:
        if not config.get("rope_parameters") and not config.get("rope_scaling"):
            config = {
                **config,
                "rope_parameters": {**DEFAULT_ROPE, "rope_theta": config.get("rope_theta", 150000.0)},
            }
        c = ConfigReader(config, where)
        num_layers = c.int("num_hidden_layers")
        hidden = c.int("hidden_size")
        heads = c.int("num_attention_heads")
        bias = c.bool("attention_bias", default=True)
        attention = AttentionSpec(
            num_heads=heads,
            num_kv_heads=c.int("num_key_value_heads", default=heads),
            head_dim=c.int("head_dim", default=hidden // heads),
            qkv_bias=bias,
            o_bias=bias,
            qk_norm="none",
            clip_qkv=None,
            sinks=True,
            sliding_window=sliding_windows(c, num_layers),
        )
        intermediate = c.int("intermediate_size")
        return read_spec(
            self.name, c, num_layers, model_type="gpt_oss", rms_norm_eps=1e-5, max_positions=131072,
            dense_intermediate_size=intermediate,
            moe_layers=tuple(True for _ in range(num_layers)),
            attention=attention,
            rope=read_rope(c),
            moe=MoeSpec(
                num_experts=c.int("num_local_experts", "num_experts"),
                top_k=c.int("num_experts_per_tok", "experts_per_token"),
                intermediate_size=intermediate,
                norm_topk_prob=False,
                routing="topk_softmax",
                router_bias=True,
                weights_in_fp32=False,
                expert_kind="gpt_oss",
                shared_intermediate_size=0,
                swiglu_limit=c.float("swiglu_limit", default=DEFAULT_SWIGLU_LIMIT),
                swiglu_alpha=c.float("swiglu_alpha", default=DEFAULT_SWIGLU_ALPHA),
            ),
            norm_style="scale_in_fp32",
        )
