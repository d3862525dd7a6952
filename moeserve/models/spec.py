"""ModelSpec: everything the engine needs to know about a model, read once from config.json.

Architectures differ in a handful of switches (q/k norm kind, biases, router rule, shared expert, which layers
are dense); they all become fields of one frozen spec so the shared layers never branch on the model type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from moeserve.errors import CheckpointError

QKNorm = Literal["none", "per_head", "full"]
# How router logits become (weights, ids):
#   softmax_topk: softmax over all experts in fp32, then top-k (optionally renormalised) - Qwen, Mixtral, OLMoE
#   topk_softmax: top-k of the raw logits, then softmax over the k selected - gpt-oss
Routing = Literal["softmax_topk", "topk_softmax"]
ExpertKind = Literal["swiglu", "gpt_oss"]
# How RMSNorm applies its weight:
#   cast_then_scale: normalise in fp32, cast to the compute dtype, then times the weight (Llama, Qwen, Mixtral)
#   scale_in_fp32:   weight kept in fp32, normalise and scale in fp32, then cast (gpt-oss)
NormStyle = Literal["cast_then_scale", "scale_in_fp32"]


@dataclass(frozen=True)
class AttentionSpec:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool
    o_bias: bool
    qk_norm: QKNorm
    clip_qkv: float | None
    sinks: bool
    sliding_window: tuple[int | None, ...]  # per layer; None = full causal attention


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    rope_type: str  # "default" | "yarn" | "linear"
    params: tuple[tuple[str, Any], ...] = ()  # the remaining rope_parameters, hashable

    def param(self, key: str, default: Any = None) -> Any:
        return dict(self.params).get(key, default)


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    routing: Routing
    router_bias: bool
    weights_in_fp32: bool  # Mixtral keeps routing weights fp32 when weighting expert outputs
    expert_kind: ExpertKind
    shared_intermediate_size: int  # 0 = no shared expert
    swiglu_limit: float | None = None
    swiglu_alpha: float | None = None


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    model_type: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    dense_intermediate_size: int
    moe_layers: tuple[bool, ...]  # per layer: True = sparse MoE block, False = dense MLP
    attention: AttentionSpec
    rope: RopeSpec
    moe: MoeSpec
    config_dtype: str | None
    norm_style: NormStyle = "cast_then_scale"

    @property
    def moe_layer_ids(self) -> list[int]:
        return [i for i, is_moe in enumerate(self.moe_layers) if is_moe]


class ConfigReader:
    """Typed access to config.json with errors that name the key (invalid config.json is a user error)."""

    def __init__(self, config: dict[str, Any], where: str) -> None:
        self.config = config
        self.where = where

    def get(self, *keys: str, default: Any = ...) -> Any:
        """The first of `keys` present (configs of one family spell some fields two ways)."""
        for key in keys:
            if key in self.config and self.config[key] is not None:
                return self.config[key]
        if default is ...:
            raise CheckpointError(f"{self.where}: missing required key '{keys[0]}'")
        return default

    def int(self, *keys: str, default: Any = ...) -> int:
        value = self.get(*keys, default=default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise CheckpointError(f"{self.where}: '{keys[0]}' must be an integer, got {value!r}")
        return value

    def float(self, *keys: str, default: Any = ...) -> float:
        value = self.get(*keys, default=default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise CheckpointError(f"{self.where}: '{keys[0]}' must be a number, got {value!r}")
        return float(value)

    def bool(self, *keys: str, default: Any = ...) -> bool:
        value = self.get(*keys, default=default)
        if not isinstance(value, bool):
            raise CheckpointError(f"{self.where}: '{keys[0]}' must be true or false, got {value!r}")
        return value


def read_rope(c: ConfigReader) -> RopeSpec:
    """RoPE from transformers 5 `rope_parameters` or the legacy `rope_theta` + `rope_scaling`."""
    params = dict(c.get("rope_parameters", default={}) or {})
    legacy = c.get("rope_scaling", default=None)
    if isinstance(legacy, dict):
        params = {**legacy, **params}
    theta = float(params.pop("rope_theta", c.float("rope_theta", default=10000.0)))
    rope_type = str(params.pop("rope_type", params.pop("type", "default")))
    if rope_type not in ("default", "yarn", "linear"):
        raise CheckpointError(f"{c.where}: rope type '{rope_type}' is not supported (default, yarn, linear)")
    return RopeSpec(theta=theta, rope_type=rope_type, params=tuple(sorted(params.items())))


def moe_layer_pattern(c: ConfigReader, num_layers: int, num_experts: int) -> tuple[bool, ...]:
    """Qwen-style rule: layer i is sparse unless listed in mlp_only_layers or off the decoder_sparse_step grid."""
    step = c.int("decoder_sparse_step", default=1)
    dense = set(c.get("mlp_only_layers", default=[]) or [])
    if step < 1:
        raise CheckpointError(f"{c.where}: 'decoder_sparse_step' must be >= 1")
    return tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers))


def base_attention(c: ConfigReader, num_layers: int, **switches: Any) -> AttentionSpec:
    hidden = c.int("hidden_size")
    heads = c.int("num_attention_heads")
    head_dim = c.int("head_dim", default=hidden // heads)
    use_window = switches.pop("use_window", False)
    window = c.get("sliding_window", default=None) if use_window else None
    windows: tuple[int | None, ...] = tuple(window for _ in range(num_layers))
    return AttentionSpec(
        num_heads=heads,
        num_kv_heads=c.int("num_key_value_heads", default=heads),
        head_dim=head_dim,
        sliding_window=windows,
        **{"qkv_bias": False, "o_bias": False, "qk_norm": "none", "clip_qkv": None, "sinks": False, **switches},
    )
