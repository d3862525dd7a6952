"""Qwen3.8-Flash-Next (transformers' qwen4_exp: Qwen4ExpForCausalLM, and the language model of
Qwen4ExpForConditionalGeneration): the Qwen3.5 hybrid (Gated DeltaNet linear attention, three linear layers to one
attention layer, softmax top-k MoE with a gated shared expert, zero-centred norms) with three additions:

- hyper-connections (`HyperSpec`): hc_count residual streams; a gated residual before each mixer and each MLP takes
  the place of the input and post-attention norms, and a last one of the final norm;
- the hashed n-gram per-layer embedding (`NgramSpec`, PLE) of the linear layers in ple_layer_ids: per token, 16 rows
  (in the flagship) of a table of hundreds of millions of rows, ~95 GiB in bf16;
- Qwen sparse attention (`QsaSpec`): an indexer in each attention layer picks the key blocks each query attends.

config.json names the attention layers "indexed_attention" (the published checkpoint: "full_attention", read alike).
The layers: models/layers/hyper_layer.py (built by models/hyper_build.py), models/mixers/qsa_attention.py.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from moeserve.errors import CheckpointError, UnsupportedModelError
from moeserve.models.archs.family import read_spec, softmax_topk_moe
from moeserve.models.archs.qwen3_next import MTP_REASON, language_model_names
from moeserve.models.ngram_hash import head_vocab_sizes, padded_rows
from moeserve.models.registry import Architecture, register
from moeserve.models.spec import (
    ConfigReader,
    HyperSpec,
    LinearAttentionSpec,
    ModelSpec,
    NgramSpec,
    QsaSpec,
    base_attention,
    read_rope,
)

LINEAR, INDEXED = "linear_attention", "indexed_attention"
_ATTENTION_NAMES = (INDEXED, "full_attention")


def _layer_types(c: ConfigReader, num_layers: int) -> list[str]:
    types = c.get("layer_types", default=None)
    if types is None:
        interval = c.int("full_attention_interval", default=4)
        return [INDEXED if (i + 1) % interval == 0 else LINEAR for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers or any(t not in (LINEAR, *_ATTENTION_NAMES)
                                                                      for t in types):
        raise CheckpointError(f"{c.where}: 'layer_types' must list '{LINEAR}' or '{INDEXED}' for each of the "
                              f"{num_layers} layers")
    return [INDEXED if t in _ATTENTION_NAMES else t for t in types]


def _qsa(c: ConfigReader, head_dim: int, rotary_dim: int) -> QsaSpec:
    fields = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")
    missing = [f for f in fields if c.get(f, default=None) is None]
    if missing:
        raise CheckpointError(f"{c.where}: the indexed attention layers need {', '.join(missing)}")
    c.int("indexer_kv_heads")  # bounded to 1: the indexer has one key head
    qsa = QsaSpec(num_heads=c.int("indexer_n_heads"), head_dim=c.int("indexer_head_dim"),
                  budget=c.int("indexer_budget"), compress_ratio=c.int("indexer_compress_ratio"))
    if qsa.budget % qsa.compress_ratio:
        raise CheckpointError(f"{c.where}: indexer_budget={qsa.budget} is not a multiple of indexer_compress_ratio="
                              f"{qsa.compress_ratio}")
    if rotary_dim > qsa.head_dim:
        raise CheckpointError(f"{c.where}: the {rotary_dim} rotated dims of head_dim={head_dim} do not fit "
                              f"indexer_head_dim={qsa.head_dim}")
    return qsa


def _eos(c: ConfigReader) -> int:
    """The end-of-text id n-grams stop at (the first of a list, as transformers takes it)."""
    eos = c.get("eos_token_id", default=None)
    first = eos[0] if isinstance(eos, list) and eos else eos
    if first is None or isinstance(first, list):
        raise CheckpointError(f"{c.where}: 'eos_token_id' must be set when ple_layer_ids names layers (n-grams stop "
                              "at it)")
    return ConfigReader({"eos_token_id": first}, c.where).int("eos_token_id")


def _ngram(c: ConfigReader, types: list[str], hidden: int) -> NgramSpec | None:
    ids = c.get("ple_layer_ids", default=[]) or []
    if not isinstance(ids, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise CheckpointError(f"{c.where}: 'ple_layer_ids' must be a list of one-based layer numbers")
    ids = sorted(set(ids))
    if not ids:
        return None
    wrong = [i for i in ids if not 1 <= i <= len(types) or types[i - 1] != LINEAR]
    if wrong:
        raise CheckpointError(f"{c.where}: ple_layer_ids {wrong} are not linear-attention layers in [1, {len(types)}]")
    n, per = c.int("ngram_size", default=3), c.int("heads_per_ngram", default=8)
    heads, embed_dim = (n - 1) * per, c.int("ple_embed_dim", default=hidden)
    if embed_dim % heads:
        raise CheckpointError(f"{c.where}: ple_embed_dim={embed_dim} is not a multiple of the {heads} n-gram heads "
                              "((ngram_size - 1) * heads_per_ngram)")
    sizes = head_vocab_sizes(c.int("ngram_vocab_size_base", default=20_000_000), len(ids), heads)
    divisor = c.int("make_ngram_vocab_size_divisible_by", default=128)
    return NgramSpec(layers=tuple(i - 1 for i in ids), embed_dim=embed_dim, ngram_size=n, heads_per_ngram=per,
                     conv_kernel=c.int("ple_conv_kernel_size", default=4),
                     split_parts=c.int("split_ngram_parts", default=512), seed=c.int("seed", default=1234),
                     eos_token_id=_eos(c), head_vocab_sizes=tuple(sizes),
                     rows=tuple(padded_rows(s, divisor) for s in sizes))


def qwen4_exp_spec(name: str, c: ConfigReader, dtype: str | None) -> ModelSpec:
    gate = c.get("output_gate_type", default=None) or c.get("hidden_act", default="silu")
    if c.get("hidden_act", default="silu") != "silu" or gate != "silu":
        raise UnsupportedModelError(f"{c.where}: hidden_act / output_gate_type other than silu is not supported for "
                                    f"{name}")
    num_layers, num_experts = c.int("num_hidden_layers"), c.int("num_experts", default=512)
    types = _layer_types(c, num_layers)
    bias = c.bool("attention_bias", default=False)
    rope = read_rope(c)
    attention = base_attention(c, num_layers, qkv_bias=bias, o_bias=bias, qk_norm="per_head", output_gate=True)
    spec = read_spec(
        name, c, num_layers, config_dtype=dtype, dense_intermediate_size=0, moe_layers=(True,) * num_layers,
        attention=attention, rope=rope, norm_style="zero_centered",
        moe=softmax_topk_moe(c, num_experts, norm_topk_prob=c.bool("norm_topk_prob", default=True),
                             shared_intermediate_size=c.int("shared_expert_intermediate_size", default=512)),
        linear_attention=LinearAttentionSpec(
            layers=tuple(i for i, t in enumerate(types) if t == LINEAR),
            num_k_heads=c.int("linear_num_key_heads", default=16),
            num_v_heads=c.int("linear_num_value_heads", default=32),
            k_head_dim=c.int("linear_key_head_dim", default=128), v_head_dim=c.int("linear_value_head_dim", default=128),
            conv_kernel=c.int("linear_conv_kernel_dim", default=4), projections="qkv_z_b_a"),
        hyper=HyperSpec(streams=c.int("hc_count", default=4), rank=c.int("hc_lowrank", default=320)),
        ngram=_ngram(c, types, c.int("hidden_size")),
    )
    if INDEXED in types:
        spec = replace(spec, qsa=_qsa(c, attention.head_dim, rope.rotary_dim(attention.head_dim)))
    return spec


@register
class Qwen4ExpText(Architecture):
    name = "Qwen4ExpForCausalLM"

    def spec(self, config: dict[str, Any], where: str) -> ModelSpec:
        c = ConfigReader(config, where)
        return qwen4_exp_spec(self.name, c, c.optional_str("dtype", "torch_dtype"))


@register
class Qwen4Exp(Architecture):
    name = "Qwen4ExpForConditionalGeneration"
    names = language_model_names()
    unserved = (("model.visual.", "the vision tower (model.visual.*): text input only"), ("mtp.", MTP_REASON))

    def spec(self, config: dict[str, Any], where: str) -> ModelSpec:
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise CheckpointError(f"{where}: {self.name} needs a 'text_config' object (the language model's fields)")
        c = ConfigReader({"tie_word_embeddings": config.get("tie_word_embeddings", False), **text}, where)
        dtype = c.optional_str("dtype", "torch_dtype") or ConfigReader(config, where).optional_str("dtype",
                                                                                                    "torch_dtype")
        return qwen4_exp_spec(self.name, c, dtype)
