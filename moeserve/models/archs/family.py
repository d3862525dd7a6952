"""The parts of a spec every model family reads the same way from config.json (no architecture is registered
here): the model's sizes, norm epsilon, context and dtype (`read_spec`), and the softmax top-k MoE of the Qwen,
Mixtral and OLMoE families (`softmax_topk_moe`). Each family's module passes its own defaults and fields."""

from __future__ import annotations

from typing import Any

from moeserve.models.spec import ConfigReader, ModelSpec, MoeSpec

_FROM_CONFIG: Any = object()  # config_dtype read from config.json's dtype / torch_dtype


def read_spec(name: str, c: ConfigReader, num_layers: int, *, model_type: str = "", rms_norm_eps: float = 1e-6,
              max_positions: int = 32768, config_dtype: str | None = _FROM_CONFIG, **fields: Any) -> ModelSpec:
    """A ModelSpec of architecture `name` with the fields every family names alike in config.json (hidden_size,
    vocab_size, rms_norm_eps, max_position_embeddings, tie_word_embeddings, dtype), `model_type`, `rms_norm_eps`
    and `max_positions` the family's defaults where config.json names none; `fields`: the family's own fields."""
    return ModelSpec(
        architecture=name,
        model_type=str(c.get("model_type", default=model_type)),
        hidden_size=c.int("hidden_size"),
        num_layers=num_layers,
        vocab_size=c.int("vocab_size"),
        rms_norm_eps=c.float("rms_norm_eps", default=rms_norm_eps),
        max_position_embeddings=c.int("max_position_embeddings", default=max_positions),
        tie_word_embeddings=c.bool("tie_word_embeddings", default=False),
        config_dtype=c.optional_str("dtype", "torch_dtype") if config_dtype is _FROM_CONFIG else config_dtype,
        **fields,
    )


def softmax_topk_moe(c: ConfigReader, num_experts: int, *, norm_topk_prob: bool, shared_intermediate_size: int = 0,
                     intermediate_key: str = "moe_intermediate_size", weights_in_fp32: bool = False) -> MoeSpec:
    """Softmax over every expert, then the top num_experts_per_tok (renormalised when `norm_topk_prob`), SwiGLU
    experts of config.json's `intermediate_key` width, a shared expert of `shared_intermediate_size` (0: none);
    `weights_in_fp32`: the routing weights scale the expert outputs in fp32 (Mixtral, as transformers does)."""
    return MoeSpec(
        num_experts=num_experts,
        top_k=c.int("num_experts_per_tok"),
        intermediate_size=c.int(intermediate_key),
        norm_topk_prob=norm_topk_prob,
        routing="softmax_topk",
        router_bias=False,
        weights_in_fp32=weights_in_fp32,
        expert_kind="swiglu",
        shared_intermediate_size=shared_intermediate_size,
    )
