"""Checkpoints at the real dimensions of published models, truncated to a few layers and experts.

Written by transformers' own `save_pretrained` on a random-init model (the independent reference), in bf16.
Hidden sizes, expert widths, head counts and head dims are the published ones (the config.json files copied in
tests/data/reference_configs), so every C++ kernel takes several blocks per row and several threads per op: that is
where two ops that accumulate in different orders round bf16 differently. What is cut, to keep a run short: the
layer count (2; 4 for Qwen3.5, its first period of 3 Gated DeltaNet + 1 gated attention), the expert count (enough
for top-k plus a few), the vocabulary (4096), and Mixtral's expert width (14336 -> 1024: one real Mixtral expert is
352 MB in bf16). GLM-4.5-Air keeps its dense first layer (first_k_dense_replace = 1), so its 2 layers are one dense
and one MoE layer. `write_gpt_oss_mxfp4` rewrites a gpt-oss checkpoint's experts in MXFP4 (the published layout).

transformers is imported inside the writers (a dev dependency).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from moeserve.bench.checkpoints import randomize_gpt_oss_zeros, randomize_zero_inits

# model name -> transformers config kwargs (published dims; counts truncated as the module docstring says)
REAL_DIMS: dict[str, dict[str, Any]] = {
    "Qwen3-30B-A3B": dict(
        model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=12, num_experts_per_tok=8,
        norm_topk_prob=True, rope_theta=1e6, rms_norm_eps=1e-6,
    ),
    "Qwen1.5-MoE-A2.7B": dict(
        model_type="qwen2_moe", hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632, num_attention_heads=16, num_key_value_heads=16, num_experts=8,
        num_experts_per_tok=4, norm_topk_prob=False, rope_theta=1e6, rms_norm_eps=1e-6,
    ),
    "OLMoE-1B-7B": dict(
        model_type="olmoe", hidden_size=2048, intermediate_size=1024, num_attention_heads=16,
        num_key_value_heads=16, num_experts=12, num_experts_per_tok=8, rope_theta=1e4, rms_norm_eps=1e-5,
        pad_token_id=1, eos_token_id=2,
    ),
    "Mixtral-8x7B": dict(
        model_type="mixtral", hidden_size=4096, intermediate_size=1024, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=4, num_experts_per_tok=2, rope_theta=1e6, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=2,
    ),
    "gpt-oss-20b": dict(
        model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=6, num_experts_per_tok=4, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"], rope_theta=150000.0, rms_norm_eps=1e-5,
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                      "original_max_position_embeddings": 4096, "truncate": False},
    ),
    # layer 0 dense (first_k_dense_replace), layer 1 MoE with the shared expert; 96 heads of 128 over hidden 4096
    "GLM-4.5-Air": dict(
        model_type="glm4_moe", hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408,
        num_attention_heads=96, num_key_value_heads=8, head_dim=128, n_routed_experts=10, num_experts_per_tok=8,
        n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1, attention_bias=True,
        use_qk_norm=False, partial_rotary_factor=0.5, routed_scaling_factor=1.0, norm_topk_prob=True,
        rope_theta=1e6, rms_norm_eps=1e-5,
    ),
}
VOCAB = 4096
# Spread logits a little more than the published init (0.02), so a random model's greedy path has few near-ties.
INIT_RANGE = 0.04


def write_real_dims(folder: Path, name: str, seed: int = 0, layers: int = 2, **overrides: Any) -> Path:
    """`name`'s dimensions (REAL_DIMS), `layers` layers, random init, saved in bf16 by transformers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {**REAL_DIMS[name], "num_hidden_layers": layers, "vocab_size": VOCAB, "max_position_embeddings": 4096,
              "initializer_range": INIT_RANGE, **overrides}
    config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    randomize_zero_inits(model)  # routing correction biases (GLM-4.5), zero at init
    if config.model_type == "gpt_oss":
        randomize_gpt_oss_zeros(model)
    model.save_pretrained(folder)
    return folder


# the fields of a published config.json that describe the file, not the model's dimensions
NOT_DIMS = ("architectures", "model_type", "torch_dtype", "dtype", "rope_scaling", "eos_token_id", "bos_token_id",
            "pad_token_id", "quantization_config", "auto_map", "transformers_version", "_source", "_note")

# Qwen3.5-35B-A3B's text_config (tests/data/reference_configs/Qwen3.5-35B-A3B.json; tests check the copy), its
# dimensions only: 40 layers in periods of 3 Gated DeltaNet + 1 gated full attention, 256 experts
QWEN3_5_35B_A3B_TEXT: dict[str, Any] = {
    "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True, "full_attention_interval": 4,
    "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"], "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_value_head_dim": 128, "max_position_embeddings": 262144, "mlp_only_layers": [],
    "moe_intermediate_size": 512, "mtp_num_hidden_layers": 1, "num_attention_heads": 16, "num_experts": 256,
    "num_experts_per_tok": 8, "num_hidden_layers": 40, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
    "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 512, "vocab_size": 248320,
    "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "default",
                        "rope_theta": 10000000, "partial_rotary_factor": 0.25},
}


def write_qwen35(folder: Path, seed: int = 0, text_config: dict[str, Any] | None = None) -> Path:
    """Qwen3.5-35B-A3B (Qwen3_5MoeForConditionalGeneration, the language model under model.language_model.*): the
    published text_config (`text_config`, default QWEN3_5_35B_A3B_TEXT) cut to 4 layers (3 Gated DeltaNet + 1 gated
    full attention, the published pattern's first period), 12 of its 256 experts (top-8); a tiny vision tower
    (never loaded by the engine)."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    text = {k: v for k, v in (text_config or QWEN3_5_35B_A3B_TEXT).items() if k not in NOT_DIMS}
    text |= {"num_hidden_layers": 4, "layer_types": text["layer_types"][:4], "num_experts": 12, "vocab_size": VOCAB,
             "max_position_embeddings": 4096, "initializer_range": 0.04}
    if text["layer_types"] != ["linear_attention"] * 3 + ["full_attention"]:
        raise ValueError(f"Qwen3.5's first 4 layers are 3 linear + 1 full attention, not {text['layer_types']}")
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"])
    config = Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model: Any = Qwen3_5MoeForConditionalGeneration(config)
    model = model.to(torch.bfloat16).eval()
    randomize_zero_inits(model)
    model.save_pretrained(folder)
    return folder


# gpt-oss's published MXFP4 checkpoints keep these in bf16
GPT_OSS_NOT_CONVERTED = [
    "model.layers.*.self_attn",
    "model.layers.*.mlp.router",
    "model.embed_tokens",
    "lm_head",
]


def write_gpt_oss_mxfp4(src: Path, folder: Path) -> Path:
    """The real HF MXFP4 layout of gpt-oss checkpoint `src` (one model.safetensors) into `folder`: each stacked
    expert projection [E, in, out] becomes `_blocks`/`_scales`."""
    from safetensors.torch import load_file

    from moeserve.formats.quantize import quantize_mxfp4

    state = load_file(src / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize_mxfp4(tensor.transpose(1, 2).contiguous())  # [E, out, in]: rows = outputs
            out[name + "_blocks"], out[name + "_scales"] = blocks, scales
        else:
            out[name] = tensor
    quant = {"quant_method": "mxfp4", "modules_to_not_convert": GPT_OSS_NOT_CONVERTED}
    return save_with_config(src, folder, out, quant)


def save_with_config(src: Path, folder: Path, state: dict[str, torch.Tensor],
                     quant_config: dict[str, Any] | None) -> Path:
    """`state` as `folder`/model.safetensors, with `src`'s config.json (its quantization_config replaced by
    `quant_config`, or dropped when None) and generation_config.json."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    if quant_config is not None:
        config["quantization_config"] = quant_config
    (folder / "config.json").write_text(json.dumps(config))
    for extra in ("generation_config.json",):
        if (src / extra).is_file():
            shutil.copy(src / extra, folder / extra)
    return folder
