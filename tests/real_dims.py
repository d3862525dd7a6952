"""Checkpoints at the real dimensions of published models, truncated to 2 layers and a few experts.

Written by transformers' own `save_pretrained` on a random-init model (the independent reference), in bf16.
Hidden sizes, expert widths, head counts and head dims are the published ones (from the config.json files in
`shared/reference/configs`), so every C++ kernel takes several blocks per row and several threads per op: that is
where two ops that accumulate in different orders round bf16 differently. What is cut, to keep CI within budget:
the layer count (2), the expert count (enough for top-k plus a few), the vocabulary (4096), and Mixtral's expert
width (14336 -> 1024: one real Mixtral expert is 352 MB in bf16). GLM-4.5-Air keeps its dense first layer
(first_k_dense_replace = 1), so its 2 layers are one dense and one MoE layer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

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
    from tests.models.checkpoints import randomize_gpt_oss_zeros, randomize_zero_inits

    randomize_zero_inits(model)  # routing correction biases (GLM-4.5), zero at init
    if config.model_type == "gpt_oss":
        randomize_gpt_oss_zeros(model)
    model.save_pretrained(folder)
    return folder
