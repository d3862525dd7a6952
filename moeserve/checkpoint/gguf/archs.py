"""What each GGUF architecture means in Hugging Face terms: its config.json, and the checkpoint name of each tensor.

One `GGUFArch` per llama.cpp architecture (general.architecture), registered in `GGUF_ARCHS`: data only. `config`
turns the metadata into the config.json the HF checkpoint would hold (keys `{arch}.block_count`, ... as llama.cpp's
loader reads them, src/llama-arch.cpp), so the model registry reads a GGUF exactly as a folder; `tensor_names`
gives each GGUF tensor's HF name(s) and the transform that undoes llama.cpp's converter (convert_hf_to_gguf.py):
- a layer's experts, stacked [E, out, in] in one tensor, are E per-expert tensors (each one contiguous byte range);
- llama (Mixtral) stores q/k rows permuted for ggml's rotary (`LlamaModel.permute`): un-permuted here;
- qwen2moe's shared-expert gate [hidden] is the HF [1, hidden];
- deepseek2 (DeepSeek-V3, Kimi-K2) keeps MLA latent: `kv_b_proj` is stored split per head into `attn_k_b`
  (the nope rows, transposed: [heads, kv_lora, nope]) and `attn_v_b` [heads, v, kv_lora]; `joined` names the parts
  and `join` rebuilds the HF [heads x (nope + v), kv_lora] from them (older files' `attn_kv_b` is read as is);
- glm4moe's block_count counts its NextN (multi-token prediction) layers: `derive` takes nextn_predict_layers off
  num_hidden_layers, and the tensors of those layers are skipped (as moeserve skips them in the HF checkpoint);
- qwen3next (Qwen3-Next) stores its zero-centred norms as 1 + w, `A_log` as `ssm_a` = -exp(A_log), conv1d squeezed to
  [channels, kernel] and `in_proj_qkvz` (per key-head groups of q, k, v, z rows) regrouped into `attn_qkv` (all q, all
  k, all v) and `attn_gate` (all z): `transforms` undo each (w = stored - 1, A_log = log(-ssm_a), in float32) and
  `qkvz_join` rebuilds in_proj_qkvz; its NextN (MTP) blocks past num_hidden_layers are skipped;
- gpt-oss stores gate and up as two stacked tensors (the converter splits the interleaved `gate_up_proj` rows:
  even rows gate, odd rows up) and their biases [E, out] beside them (`ffn_*_exps.bias`, per expert one row):
  each expert is read as its own gate_proj / up_proj / down_proj, weight and bias, which the gpt_oss expert plan
  holds gate rows then up rows (models/experts/plans.py).
An architecture, or a metadata key, that moeserve cannot map is refused in one line naming it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from moeserve.errors import CheckpointError, UnsupportedModelError

Transform = Callable[[torch.Tensor], torch.Tensor]
Join = Callable[[list[torch.Tensor]], torch.Tensor]  # the decoded parts of one HF tensor -> that tensor
# what an architecture's metadata and tensor shapes imply beyond key copies: updates the config in place
Derive = Callable[[dict[str, Any], Mapping[str, Any], Mapping[str, tuple[int, ...]], Path], None]
REQUIRED = object()  # a metadata key without a default

_LAYER = "model.layers.{L}."
# GGUF tensor name (after "blk.{L}.") -> HF name, the layers of Qwen-style checkpoints
LAYER_TENSORS: Mapping[str, str] = MappingProxyType({
    "attn_norm.weight": _LAYER + "input_layernorm.weight",
    "ffn_norm.weight": _LAYER + "post_attention_layernorm.weight",
    **{f"attn_{g}.{kind}": f"{_LAYER}self_attn.{h}_proj.{kind}"
       for g, h in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o")) for kind in ("weight", "bias")},
    "attn_q_norm.weight": _LAYER + "self_attn.q_norm.weight",
    "attn_k_norm.weight": _LAYER + "self_attn.k_norm.weight",
    "ffn_gate_inp.weight": _LAYER + "mlp.gate.weight",
    "ffn_gate_inp_shexp.weight": _LAYER + "mlp.shared_expert_gate.weight",
    **{f"ffn_{p}_shexp.weight": f"{_LAYER}mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")},
    **{f"ffn_{p}.weight": f"{_LAYER}mlp.{p}_proj.weight" for p in ("gate", "up", "down")},
})
EXPERT_TENSORS: Mapping[str, str] = MappingProxyType({
    f"ffn_{p}_exps.weight": f"{_LAYER}mlp.experts.{{E}}.{p}_proj.weight" for p in ("gate", "up", "down")})
GLOBAL_TENSORS: Mapping[str, str] = {"token_embd.weight": "model.embed_tokens.weight",
                                     "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")

# HF config key -> (GGUF key after "{arch}.", default); every architecture reads these
COMMON_KEYS: Mapping[str, tuple[str, Any]] = {
    "num_hidden_layers": ("block_count", REQUIRED),
    "hidden_size": ("embedding_length", REQUIRED),
    "num_attention_heads": ("attention.head_count", REQUIRED),
    "max_position_embeddings": ("context_length", REQUIRED),
    "rms_norm_eps": ("attention.layer_norm_rms_epsilon", REQUIRED),
    "rope_theta": ("rope.freq_base", 10000.0),
    "num_experts_per_tok": ("expert_used_count", REQUIRED),
    "intermediate_size": ("feed_forward_length", 0),
}


@dataclass(frozen=True)
class GGUFArch:
    """One llama.cpp architecture: its HF name and model_type, extra config keys, fixed values, tensor names."""

    gguf_name: str
    hf_architecture: str
    model_type: str
    keys: Mapping[str, tuple[str, Any]] = field(default_factory=dict)  # beyond COMMON_KEYS
    fixed: Mapping[str, Any] = field(default_factory=dict)  # HF keys llama.cpp's graph implies (norm_topk_prob)
    layer_tensors: Mapping[str, str] = field(default_factory=lambda: LAYER_TENSORS)
    expert_tensors: Mapping[str, str] = field(default_factory=lambda: EXPERT_TENSORS)
    permute_qk: bool = False  # q/k rows permuted by the converter (llama)
    derive: Derive | None = None
    joined: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # HF stem -> its GGUF parts, in order
    join: Callable[[Mapping[str, Any]], Join] | None = None  # the Join of `joined`'s parts, given the config
    transforms: Mapping[str, Callable[[Mapping[str, Any]], Transform]] = field(default_factory=dict)  # stem -> undo

    def config(self, meta: Mapping[str, Any], tensor_shapes: Mapping[str, tuple[int, ...]], where: Path
               ) -> dict[str, Any]:
        """The config.json of this GGUF (metadata `meta`, the GGUF tensors' shapes)."""
        config: dict[str, Any] = {"architectures": [self.hf_architecture], "model_type": self.model_type,
                                  "torch_dtype": "bfloat16", "hidden_act": "silu"}
        for hf_key, (key, default) in {**COMMON_KEYS, **self.keys}.items():
            full = f"{self.gguf_name}.{key}"
            if full in meta:
                config[hf_key] = _number(meta[full], full, where)
            elif default is REQUIRED:
                raise CheckpointError(f"{where}: metadata key '{full}' is missing ({self.gguf_name} needs it)")
            elif default is not None:
                config[hf_key] = default
        config.setdefault("num_key_value_heads", config["num_attention_heads"])
        config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
        config["vocab_size"] = _vocab_size(meta, tensor_shapes, where)
        config["tie_word_embeddings"] = "output.weight" not in tensor_shapes
        config["attention_bias"] = config["qkv_bias"] = "blk.0.attn_q.bias" in tensor_shapes
        config.update(self.fixed)
        if "mlp_only_layers" in self.fixed:  # Qwen: a block without a router is a dense MLP layer
            config["mlp_only_layers"] = [L for L in range(config["num_hidden_layers"])
                                         if f"blk.{L}.ffn_gate_inp.weight" not in tensor_shapes]
        config.update(_rope_scaling(meta, self.gguf_name, where))
        if self.derive is not None:
            self.derive(config, meta, tensor_shapes, where)
        for key in ("bos_token_id", "eos_token_id"):
            if f"tokenizer.ggml.{key}" in meta:
                config[key] = meta[f"tokenizer.ggml.{key}"]
        return config

    def tensor_names(self, gguf_name: str, num_experts: int, num_layers: int | None = None
                     ) -> tuple[str, list[str]] | None:
        """("expert" | "dense", HF names) of a GGUF tensor: E names for stacked experts; ("skipped", []) for a block
        past `num_layers` (glm4moe's NextN layers); None: not one it maps."""
        if gguf_name in GLOBAL_TENSORS:
            return "dense", [GLOBAL_TENSORS[gguf_name]]
        m = _BLOCK.fullmatch(gguf_name)
        if m is None:
            return None
        layer, stem = m.group(1), m.group(2)
        if num_layers is not None and int(layer) >= num_layers:
            return "skipped", []
        if stem in self.expert_tensors:
            return "expert", [self.expert_tensors[stem].format(L=layer, E=e) for e in range(num_experts)]
        for hf, parts in self.joined.items():
            if stem in parts:
                return f"part {parts.index(stem)} of {len(parts)}", [hf.format(L=layer)]
        if stem in self.layer_tensors:
            return "dense", [self.layer_tensors[stem].format(L=layer)]
        return None

    def transform(self, gguf_name: str, config: Mapping[str, Any]) -> Transform | None:
        """What undoes the converter for this tensor (None: stored as HF holds it)."""
        stem = gguf_name.split(".", 2)[-1] if gguf_name.startswith("blk.") else gguf_name
        if stem in self.transforms:
            return self.transforms[stem](config)
        if stem == "ffn_gate_inp_shexp.weight":
            return lambda w: w.reshape(1, -1)
        if self.permute_qk and stem in ("attn_q.weight", "attn_k.weight"):
            heads = config["num_attention_heads"] if stem == "attn_q.weight" else config["num_key_value_heads"]
            return lambda w: unpermute_rows(w, heads)
        return None


def unpermute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of llama.cpp's `LlamaModel.permute`: per head, rows (pairs interleaved) back to halves."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _number(value: Any, key: str, where: Path) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CheckpointError(f"{where}: metadata key '{key}' must be a number, got {str(value)[:40]}")
    # GGUF floats are float32: the shortest decimal of that float32 is the value the HF config held (1e-06)
    return float(str(np.float32(value))) if isinstance(value, float) else value


def _vocab_size(meta: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], where: Path) -> int:
    if "token_embd.weight" not in shapes:
        raise CheckpointError(f"{where}: tensor 'token_embd.weight' is missing")
    rows = shapes["token_embd.weight"][0]
    tokens = meta.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and tokens and len(tokens) > rows:
        raise CheckpointError(f"{where}: tokenizer.ggml.tokens holds {len(tokens)} tokens, but token_embd.weight "
                              f"has {rows} rows")
    return rows


def _rope_scaling(meta: Mapping[str, Any], arch: str, where: Path) -> dict[str, Any]:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return {}
    if kind not in ("yarn", "linear"):
        raise UnsupportedModelError(f"{where}: metadata {arch}.rope.scaling.type={kind!r} is not supported "
                                    "(none, linear, yarn)")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    scaling: dict[str, Any] = {"rope_type": kind, "factor": factor}
    if kind == "yarn":
        scaling["original_max_position_embeddings"] = meta.get(f"{arch}.rope.scaling.original_context_length")
    return {"rope_scaling": scaling}


def _glm4moe(config: dict[str, Any], meta: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], where: Path
             ) -> None:
    """GLM-4.5's config from llama.cpp's glm4moe keys (src/models/glm4-moe.cpp): block_count less the NextN layers,
    partial rotary from rope.dimension_count, sigmoid routing, the q/k norms present or not."""
    nextn = meta.get("glm4moe.nextn_predict_layers", 0)
    config["num_nextn_predict_layers"] = nextn
    config["num_hidden_layers"] -= nextn
    _sigmoid_gating(meta, "glm4moe", where, default=SIGMOID)
    rotated = meta.get("glm4moe.rope.dimension_count", config["head_dim"] // 2)
    config["partial_rotary_factor"] = rotated / config["head_dim"]
    config["norm_topk_prob"] = bool(meta.get("glm4moe.expert_weights_norm", False))
    config["use_qk_norm"] = "blk.0.attn_q_norm.weight" in shapes


def _deepseek2(config: dict[str, Any], meta: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], where: Path
               ) -> None:
    """DeepSeek-V3's config from llama.cpp's deepseek2 keys (src/models/deepseek2.cpp): MLA's widths from the
    latent key / value lengths (`_mla`: the decompressed heads'; older files: key_length / value_length are),
    every head its own kv head (head_count_kv 1 is MLA's one latent row), sigmoid noaux_tc routing, yarn's mscale
    from its log multiplier (llama.cpp keeps 0.1 * mscale_all_dim only, so mscale = mscale_all_dim)."""
    a = "deepseek2."
    _sigmoid_gating(meta, "deepseek2", where, default=SOFTMAX)
    rope = config["qk_rope_head_dim"]
    key = meta.get(a + "attention.key_length_mla", meta.get(a + "attention.key_length"))
    value = meta.get(a + "attention.value_length_mla", meta.get(a + "attention.value_length"))
    if not isinstance(key, int) or not isinstance(value, int):
        raise CheckpointError(f"{where}: metadata key '{a}attention.key_length_mla' is missing (deepseek2 needs it)")
    config.update(qk_nope_head_dim=key - rope, v_head_dim=value, num_key_value_heads=config["num_attention_heads"],
                  scoring_func="sigmoid", topk_method="noaux_tc", rope_interleave=True)
    config.pop("head_dim", None)
    config["norm_topk_prob"] = bool(meta.get(a + "expert_weights_norm", False))
    nextn = meta.get(a + "nextn_predict_layers", 0)
    config["num_hidden_layers"] -= nextn
    if "rope_scaling" in config and config["rope_scaling"]["rope_type"] == "yarn":
        mscale = float(str(np.float32(meta.get(a + "rope.scaling.yarn_log_multiplier", 0.0) / 0.1)))
        config["rope_scaling"].update(mscale=mscale, mscale_all_dim=mscale, beta_fast=32.0, beta_slow=1.0)


def kv_b_join(config: Mapping[str, Any]) -> Join:
    """attn_k_b [heads, kv_lora, nope] and attn_v_b [heads, v, kv_lora] -> kv_b_proj [heads x (nope + v), kv_lora]
    (the inverse of the converter's split, conversion/deepseek.py)."""
    def join(parts: list[torch.Tensor]) -> torch.Tensor:
        k_b, v_b = parts
        return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, k_b.shape[1])

    return join


def _sigmoid_gating(meta: Mapping[str, Any], arch: str, where: Path, default: int) -> None:
    gating = meta.get(f"{arch}.expert_gating_func", default)
    if gating != SIGMOID:
        raise UnsupportedModelError(f"{where}: metadata {arch}.expert_gating_func={gating!r} is not supported "
                                    f"({SIGMOID}: sigmoid)")


SIGMOID, SOFTMAX = 2, 1  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID / _SOFTMAX
_GLM = "model.layers.{L}.mlp."
GLM4MOE_LAYER_TENSORS: Mapping[str, str] = MappingProxyType({
    **{k: v for k, v in LAYER_TENSORS.items() if k not in ("ffn_norm.weight", "ffn_gate_inp_shexp.weight")},
    "post_attention_norm.weight": _LAYER + "post_attention_layernorm.weight",
    "exp_probs_b.bias": _GLM + "gate.e_score_correction_bias",
    **{f"ffn_{p}_shexp.weight": f"{_GLM}shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")},
})
_ATTN = _LAYER + "self_attn."
DEEPSEEK2_LAYER_TENSORS: Mapping[str, str] = MappingProxyType({
    **{k: v for k, v in GLM4MOE_LAYER_TENSORS.items() if k != "post_attention_norm.weight"},
    "ffn_norm.weight": _LAYER + "post_attention_layernorm.weight",
    "attn_q_a.weight": _ATTN + "q_a_proj.weight", "attn_q_a_norm.weight": _ATTN + "q_a_layernorm.weight",
    "attn_q_b.weight": _ATTN + "q_b_proj.weight", "attn_kv_a_mqa.weight": _ATTN + "kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": _ATTN + "kv_a_layernorm.weight", "attn_kv_b.weight": _ATTN + "kv_b_proj.weight",
})
_MIXTRAL = "model.layers.{L}.block_sparse_moe."
_LIN = _LAYER + "linear_attn."
QWEN3NEXT_LAYER_TENSORS: Mapping[str, str] = MappingProxyType({
    **{k: v for k, v in LAYER_TENSORS.items() if k != "ffn_norm.weight"},
    "post_attention_norm.weight": _LAYER + "post_attention_layernorm.weight",
    "ssm_ba.weight": _LIN + "in_proj_ba.weight", "ssm_conv1d.weight": _LIN + "conv1d.weight", "ssm_a": _LIN + "A_log",
    "ssm_dt.bias": _LIN + "dt_bias", "ssm_norm.weight": _LIN + "norm.weight", "ssm_out.weight": _LIN + "out_proj.weight",
})


def _minus_one(config: Mapping[str, Any]) -> Transform:
    return lambda w: w - 1.0


def _a_log(config: Mapping[str, Any]) -> Transform:
    return lambda a: torch.log(-a)


def _unsqueeze_conv(config: Mapping[str, Any]) -> Transform:
    return lambda w: w.unsqueeze(1)


def qkvz_join(config: Mapping[str, Any]) -> Join:
    """attn_qkv [all q, all k, all v rows] and attn_gate [all z rows] -> in_proj_qkvz, per key head [q, k, v, z] rows
    (the inverse of the converter's regrouping, conversion/qwen.py)."""
    nk, dk = config["linear_num_key_heads"], config["linear_key_head_dim"]
    per_group = config["linear_num_value_heads"] // nk * config["linear_value_head_dim"]

    def join(parts: list[torch.Tensor]) -> torch.Tensor:
        qkv, z = parts
        q, k, v = torch.split(qkv, [nk * dk, nk * dk, nk * per_group])
        grouped = [t.reshape(nk, -1, t.shape[-1]) for t in (q, k, v, z)]
        return torch.cat(grouped, dim=1).reshape(-1, qkv.shape[-1])

    return join


def _qwen3next(config: dict[str, Any], meta: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], where: Path
               ) -> None:
    """Qwen3-Next's config from llama.cpp's qwen3next keys (src/models/qwen3next.cpp): the linear-attention widths
    from ssm.*, the layer kinds from attention.recurrent_layers (else every full_attention_interval-th layer full),
    the rotated fraction from rope.dimension_count, block_count less the NextN layers."""
    a = "qwen3next."
    config["num_hidden_layers"] -= meta.get(a + "nextn_predict_layers", 0)
    layers = config["num_hidden_layers"]
    config["linear_value_head_dim"] = meta.get(a + "ssm.inner_size", 0) // config["linear_num_value_heads"]
    recurrent = meta.get(a + "attention.recurrent_layers")
    if isinstance(recurrent, list) and len(recurrent) >= layers:
        config["layer_types"] = ["linear_attention" if r else "full_attention" for r in recurrent[:layers]]
    elif recurrent is not None:
        raise CheckpointError(f"{where}: metadata key '{a}attention.recurrent_layers' must hold a flag per layer")
    rotated = meta.get(a + "rope.dimension_count", config["head_dim"])
    config["partial_rotary_factor"] = rotated / config["head_dim"]


GPT_OSS_LAYER_TENSORS: Mapping[str, str] = MappingProxyType({
    **{k: v for k, v in LAYER_TENSORS.items() if k.startswith(("attn_", "ffn_gate_inp.weight"))},
    "post_attention_norm.weight": _LAYER + "post_attention_layernorm.weight",
    "attn_sinks.weight": _ATTN + "sinks",
    "ffn_gate_inp.weight": _LAYER + "mlp.router.weight", "ffn_gate_inp.bias": _LAYER + "mlp.router.bias",
})
GPT_OSS_EXPERT_TENSORS: Mapping[str, str] = MappingProxyType({
    f"ffn_{p}_exps.{kind}": f"{_LAYER}mlp.experts.{{E}}.{p}_proj.{kind}"
    for p in ("gate", "up", "down") for kind in ("weight", "bias")})


def _gpt_oss(config: dict[str, Any], meta: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], where: Path
             ) -> None:
    """gpt-oss's config from llama.cpp's gpt-oss keys (src/models/openai-moe.cpp): the sliding layers from
    attention.sliding_window_pattern (an array of flags, or every n-th layer full; default 2: even layers slide),
    YaRN with its betas and, as every released gpt-oss config.json holds it, truncate false (llama.cpp keeps no such
    key). The clamped SwiGLU's limit and alpha are llama.cpp's constants (7.0, 1.702): the spec's defaults."""
    layers, key = config["num_hidden_layers"], "gpt-oss.attention.sliding_window_pattern"
    pattern = meta.get(key, 2)
    if isinstance(pattern, list) and len(pattern) == layers:
        sliding = [bool(p) for p in pattern]
    elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 0:
        sliding = [pattern == 0 or L % pattern < pattern - 1 for L in range(layers)]
    else:
        raise CheckpointError(f"{where}: metadata key '{key}' must be {layers} flags or a layer count, got "
                              f"{str(pattern)[:40]}")
    config["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    scaling = config.pop("rope_scaling", None)
    if scaling is not None:
        if scaling["rope_type"] != "yarn":
            raise UnsupportedModelError(f"{where}: metadata gpt-oss.rope.scaling.type={scaling['rope_type']!r} is "
                                        "not supported for gpt-oss (yarn)")
        for beta, default in (("beta_fast", 32.0), ("beta_slow", 1.0)):
            key = f"gpt-oss.rope.scaling.yarn_{beta}"
            scaling[beta] = _number(meta.get(key, default), key, where)
        config["rope_parameters"] = {**scaling, "rope_theta": config.pop("rope_theta"), "truncate": False}


GGUF_ARCHS: Mapping[str, GGUFArch] = {a.gguf_name: a for a in (
    GGUFArch("qwen3moe", "Qwen3MoeForCausalLM", "qwen3_moe",
             keys={"num_experts": ("expert_count", REQUIRED), "moe_intermediate_size":
                   ("expert_feed_forward_length", REQUIRED), "head_dim": ("attention.key_length", None),
                   "num_key_value_heads": ("attention.head_count_kv", None)},
             fixed={"norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}),
    GGUFArch("qwen2moe", "Qwen2MoeForCausalLM", "qwen2_moe",
             keys={"num_experts": ("expert_count", REQUIRED), "moe_intermediate_size":
                   ("expert_feed_forward_length", REQUIRED), "shared_expert_intermediate_size":
                   ("expert_shared_feed_forward_length", 0), "num_key_value_heads": ("attention.head_count_kv", None)},
             fixed={"norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": []}),
    GGUFArch("olmoe", "OlmoeForCausalLM", "olmoe",
             keys={"num_experts": ("expert_count", REQUIRED), "num_key_value_heads": ("attention.head_count_kv", None),
                   "clip_qkv": ("attention.clamp_kqv", None)},
             fixed={"norm_topk_prob": False}),
    GGUFArch("llama", "MixtralForCausalLM", "mixtral",
             keys={"num_local_experts": ("expert_count", REQUIRED),
                   "num_key_value_heads": ("attention.head_count_kv", None)},
             layer_tensors={**LAYER_TENSORS, "ffn_gate_inp.weight": _MIXTRAL + "gate.weight"},
             expert_tensors={f"ffn_{p}_exps.weight": f"{_MIXTRAL}experts.{{E}}.{w}.weight"
                             for p, w in (("gate", "w1"), ("up", "w3"), ("down", "w2"))},
             permute_qk=True),
    GGUFArch("qwen3next", "Qwen3NextForCausalLM", "qwen3_next",
             keys={"num_experts": ("expert_count", REQUIRED), "moe_intermediate_size":
                   ("expert_feed_forward_length", REQUIRED), "shared_expert_intermediate_size":
                   ("expert_shared_feed_forward_length", 0), "head_dim": ("attention.key_length", None),
                   "num_key_value_heads": ("attention.head_count_kv", None),
                   "linear_conv_kernel_dim": ("ssm.conv_kernel", REQUIRED),
                   "linear_key_head_dim": ("ssm.state_size", REQUIRED),
                   "linear_num_key_heads": ("ssm.group_count", REQUIRED),
                   "linear_num_value_heads": ("ssm.time_step_rank", REQUIRED),
                   "full_attention_interval": ("full_attention_interval", 4)},
             fixed={"norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []},
             layer_tensors=QWEN3NEXT_LAYER_TENSORS, derive=_qwen3next,
             joined={_LIN + "in_proj_qkvz.weight": ("attn_qkv.weight", "attn_gate.weight")}, join=qkvz_join,
             transforms={**{n: _minus_one for n in ("attn_norm.weight", "post_attention_norm.weight",
                                                     "attn_q_norm.weight", "attn_k_norm.weight", "output_norm.weight")},
                         "ssm_a": _a_log, "ssm_conv1d.weight": _unsqueeze_conv}),
    GGUFArch("gpt-oss", "GptOssForCausalLM", "gpt_oss",
             keys={"num_local_experts": ("expert_count", REQUIRED), "intermediate_size":
                   ("expert_feed_forward_length", REQUIRED), "head_dim": ("attention.key_length", None),
                   "num_key_value_heads": ("attention.head_count_kv", None),
                   "sliding_window": ("attention.sliding_window", REQUIRED)},
             layer_tensors=GPT_OSS_LAYER_TENSORS, expert_tensors=GPT_OSS_EXPERT_TENSORS, derive=_gpt_oss),
    GGUFArch("glm4moe", "Glm4MoeForCausalLM", "glm4_moe",
             keys={"n_routed_experts": ("expert_count", REQUIRED), "moe_intermediate_size":
                   ("expert_feed_forward_length", REQUIRED), "head_dim": ("attention.key_length", None),
                   "num_key_value_heads": ("attention.head_count_kv", None),
                   "n_shared_experts": ("expert_shared_count", REQUIRED),
                   "first_k_dense_replace": ("leading_dense_block_count", 0),
                   "routed_scaling_factor": ("expert_weights_scale", 1.0),
                   "n_group": ("expert_group_count", 1), "topk_group": ("expert_group_used_count", 1)},
             layer_tensors=GLM4MOE_LAYER_TENSORS, derive=_glm4moe),
    GGUFArch("deepseek2", "DeepseekV3ForCausalLM", "deepseek_v3",
             keys={"n_routed_experts": ("expert_count", REQUIRED), "moe_intermediate_size":
                   ("expert_feed_forward_length", REQUIRED), "n_shared_experts": ("expert_shared_count", REQUIRED),
                   "first_k_dense_replace": ("leading_dense_block_count", 0),
                   "routed_scaling_factor": ("expert_weights_scale", 1.0),
                   "n_group": ("expert_group_count", 1), "topk_group": ("expert_group_used_count", 1),
                   "q_lora_rank": ("attention.q_lora_rank", None), "kv_lora_rank": ("attention.kv_lora_rank",
                                                                                   REQUIRED),
                   "qk_rope_head_dim": ("rope.dimension_count", REQUIRED)},
             layer_tensors=DEEPSEEK2_LAYER_TENSORS, derive=_deepseek2,
             joined={_ATTN + "kv_b_proj.weight": ("attn_k_b.weight", "attn_v_b.weight")}, join=kv_b_join),
)}


def gguf_arch(meta: Mapping[str, Any], where: Path) -> GGUFArch:
    """The `GGUFArch` of general.architecture; one line naming the key and the supported ones otherwise."""
    name = meta.get("general.architecture")
    arch = GGUF_ARCHS.get(name) if isinstance(name, str) else None
    if arch is None:
        raise UnsupportedModelError(f"{where}: general.architecture={name!r} is not read by moeserve; supported: "
                                    f"{', '.join(sorted(GGUF_ARCHS))}")
    return arch
