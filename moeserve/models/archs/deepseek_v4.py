"""DeepSeek-V4 (DeepseekV4ForCausalLM, model_type deepseek_v4; DeepSeek-V4-Flash: 284B total, 13B active):

- attention (`CompressedAttentionSpec`): every layer attends a sliding window of raw keys through one shared
  key=value head of head_dim values with a learned sink per head and a grouped low-rank output; layers of
  compression ratio 4 ("compressed sparse attention") add overlapping pooled entries chosen per query by a
  lightning indexer, layers of ratio 128 ("heavily compressed attention") every pooled entry;
- manifold-constrained hyper-connections (`MhcSpec`): hc_mult residual streams mixed by Sinkhorn-projected
  matrices;
- MoE: sqrtsoftplus scoring, top-k by score + correction bias; the first num_hash_layers layers pick their experts
  from a token-id table (tid2eid); SwiGLU experts and one shared expert, both clamped at swiglu_limit.

config.json comes in two spellings, both read: transformers' (layer_types, compress_rates, mlp_layer_types,
partial_rotary_factor, rope_parameters {main, compress}) and the published one (compress_ratios per layer, one
past the last: the MTP layer's; num_hash_layers; qk_rope_head_dim; rope_scaling for the compressed layers).
Checkpoint names: DeepSeek's own (attn.wq_a, ffn.experts.{E}.w1, hc_attn_fn ...) under `model.` as transformers'
save_pretrained writes them; the published checkpoint's MTP module (mtp.*) is not served.

The layers: models/mixers/compressed_mixer.py (attention, torch only), models/layers/mhc_layer.py (the streams),
models/experts/moe.py (SqrtSoftplus, HashRouting), expert kind swiglu_clamp (models/experts/plans.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from moeserve.errors import CheckpointError, UnsupportedModelError
from moeserve.models.archs.family import read_spec
from moeserve.models.archs.glm4_moe import require
from moeserve.models.registry import Architecture, WeightNames, register
from moeserve.models.spec import (
    CompressedAttentionSpec,
    ConfigReader,
    MhcSpec,
    ModelSpec,
    MoeSpec,
    RopeSpec,
    base_attention,
    check_float,
    read_rope,
)

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
_RATIO_TYPES = {0: SLIDING, 4: CSA, 128: HCA}  # the published compress_ratios, as transformers reads them
_L = "model.layers.{L}"
NAMES = WeightNames(
    lm_head="head",
    input_norm=_L + ".attn_norm.weight",
    post_norm=_L + ".ffn_norm.weight",
    router=_L + ".ffn.gate",
    router_correction_bias=_L + ".ffn.gate.bias",
    expert_gate=_L + ".ffn.experts.{E}.w1",
    expert_up=_L + ".ffn.experts.{E}.w3",
    expert_down=_L + ".ffn.experts.{E}.w2",
    shared_gate=_L + ".ffn.shared_experts.w1",
    shared_up=_L + ".ffn.shared_experts.w3",
    shared_down=_L + ".ffn.shared_experts.w2",
)


def _layer_types(c: ConfigReader, num_layers: int) -> list[str]:
    types = c.get("layer_types", default=None)
    if types is None:
        ratios = c.get("compress_ratios", default=None)
        if ratios is None:  # transformers' default: two heavily compressed layers, then CSA / HCA in turn
            return [HCA] * min(num_layers, 2) + [CSA if i % 2 else HCA for i in range(max(num_layers - 2, 0))]
        if not isinstance(ratios, list) or len(ratios) < num_layers or any(r not in _RATIO_TYPES for r in ratios):
            raise CheckpointError(f"{c.where}: 'compress_ratios' must list 0, 4 or 128 for each of the {num_layers} "
                                  "layers")
        types = [_RATIO_TYPES[r] for r in ratios]
    if not isinstance(types, list) or len(types) < num_layers or any(t not in (SLIDING, CSA, HCA) for t in types):
        raise CheckpointError(f"{c.where}: 'layer_types' must list '{SLIDING}', '{CSA}' or '{HCA}' for each of the "
                              f"{num_layers} layers")
    return types[:num_layers]


def _ratios(c: ConfigReader) -> dict[str, int]:
    rates = c.get("compress_rates", default={}) or {}
    if not isinstance(rates, dict):
        raise CheckpointError(f"{c.where}: 'compress_rates' must be an object")
    csa = c.int("compress_rate_csa", default=rates.get(CSA, 4))
    hca = c.int("compress_rate_hca", default=rates.get(HCA, 128))
    for name, value in ((CSA, csa), (HCA, hca)):
        if not 1 <= value <= 2**16:
            raise CheckpointError(f"{c.where}: the compression rate of {name} is {value}, out of range [1, 65536]")
    return {SLIDING: 0, CSA: csa, HCA: hca}


def _hash_layers(c: ConfigReader, num_layers: int) -> tuple[int, ...]:
    types = c.get("mlp_layer_types", default=None)
    if types is None:
        return tuple(range(min(num_layers, c.int("num_hash_layers", default=3))))
    if not isinstance(types, list) or len(types) < num_layers or not set(types) <= {"hash_moe", "moe"}:
        raise CheckpointError(f"{c.where}: 'mlp_layer_types' must list 'hash_moe' or 'moe' for each of the "
                              f"{num_layers} layers")
    return tuple(i for i in range(num_layers) if types[i] == "hash_moe")


def _ropes(c: ConfigReader, head_dim: int) -> tuple[RopeSpec, RopeSpec]:
    """(main, compress): the sliding-window layers' rotary and that of the compressed layers, as transformers'
    DeepseekV4Config derives them: main plain at rope_theta; compress at compress_rope_theta with the rope_scaling
    (yarn) and its cos/sin factor 1 (attention_factor). Both rotate qk_rope_head_dim dims (default 64 / head_dim)."""
    nested = c.get("rope_parameters", default={}) or {}
    if isinstance(nested, dict) and isinstance(nested.get("main"), dict) and isinstance(nested.get("compress"), dict):
        main = read_rope(ConfigReader({"rope_parameters": nested["main"]}, c.where))
        return main, read_rope(ConfigReader({"rope_parameters": nested["compress"]}, c.where))
    rope_dim = c.optional_int("qk_rope_head_dim")
    partial = (rope_dim / head_dim if rope_dim is not None
               else check_float(c.get("partial_rotary_factor", default=64 / 512), "partial_rotary_factor", c.where))
    scaling = c.get("rope_scaling", default=None) or {}
    if not isinstance(scaling, dict):
        raise CheckpointError(f"{c.where}: 'rope_scaling' must be an object")
    main = RopeSpec(c.float("rope_theta", default=10000.0), "default", (), partial)
    compress = {**scaling, "rope_theta": c.float("compress_rope_theta", default=160000.0),
                "partial_rotary_factor": partial}
    if compress.get("rope_type", compress.get("type")) == "yarn":
        compress.setdefault("attention_factor", 1.0)
    return main, read_rope(ConfigReader({"rope_parameters": compress}, c.where))


def _moe(c: ConfigReader, num_layers: int) -> MoeSpec:
    width = c.int("moe_intermediate_size")
    return MoeSpec(
        num_experts=c.int("n_routed_experts", "num_local_experts"), top_k=c.int("num_experts_per_tok"),
        intermediate_size=width, norm_topk_prob=True, routing="sqrtsoftplus", router_bias=False,
        weights_in_fp32=False, expert_kind="swiglu_clamp", shared_intermediate_size=c.int("n_shared_experts", default=1) * width,
        swiglu_limit=c.float("swiglu_limit", default=10.0), shared_gated=False,
        routed_scaling_factor=c.float("routed_scaling_factor", default=1.5), correction_bias=True,
        hash_layers=_hash_layers(c, num_layers))


def deepseek_v4_spec(name: str, config: dict[str, Any], where: str) -> ModelSpec:
    c = ConfigReader(config, where)
    require(c, name, hidden_act="silu", scoring_func="sqrtsoftplus")
    if c.int("num_key_value_heads", default=1) != 1:
        raise UnsupportedModelError(f"{where}: num_key_value_heads must be 1 for {name} (one shared key=value head)")
    num_layers = c.int("num_hidden_layers")
    types, rates = _layer_types(c, num_layers), _ratios(c)
    window = c.int("sliding_window", default=128)
    attention = replace(base_attention(c, num_layers, sinks=True), sliding_window=(window,) * num_layers)
    main, compress = _ropes(c, attention.head_dim)
    heads, groups = attention.num_heads, c.int("o_groups", default=8)
    if heads % groups:
        raise CheckpointError(f"{where}: num_attention_heads={heads} is not a multiple of o_groups={groups}")
    compressed = CompressedAttentionSpec(
        q_lora_rank=c.int("q_lora_rank", default=1024), o_groups=groups, o_lora_rank=c.int("o_lora_rank", default=1024),
        window=window, ratios=tuple(rates[t] for t in types), indexed=tuple(t == CSA for t in types),
        index_n_heads=c.int("index_n_heads", default=64), index_head_dim=c.int("index_head_dim", default=128),
        index_topk=c.int("index_topk", default=512), compress_rope=compress)
    return read_spec(
        name, c, num_layers, model_type="deepseek_v4", max_positions=1048576, dense_intermediate_size=0,
        moe_layers=(True,) * num_layers, attention=attention, rope=main, moe=_moe(c, num_layers),
        compressed=compressed,
        mhc=MhcSpec(streams=c.int("hc_mult", default=4), sinkhorn_iters=c.int("hc_sinkhorn_iters", default=20),
                    eps=c.float("hc_eps", default=1e-6)))


@register
class DeepseekV4(Architecture):
    name = "DeepseekV4ForCausalLM"
    names = NAMES
    unserved = (("mtp.", "the multi-token-prediction module (mtp.*): not used for decoding"),)

    def spec(self, config: dict[str, Any], where: str) -> ModelSpec:
        return deepseek_v4_spec(self.name, config, where)
