"""Nemotron-H checkpoints transformers writes, for tests: tiny, and at the real dimensions of
Nemotron-3-Nano-30B-A3B (shared/reference/configs) truncated to a few layers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# NVIDIA-Nemotron-3-Nano-30B-A3B's config.json, the fields read (shared/reference/configs/Nemotron-3-Nano-30B-A3B.json)
NEMOTRON_3_NANO = {
    "architectures": ["NemotronHForCausalLM"], "attention_bias": False, "chunk_size": 128, "conv_kernel": 4,
    "expand": 2, "head_dim": 128, "hidden_size": 2688,
    "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
    "intermediate_size": 1856, "layer_norm_epsilon": 1e-05, "mamba_head_dim": 64, "mamba_hidden_act": "silu",
    "mamba_num_heads": 64, "mamba_proj_bias": False, "max_position_embeddings": 262144, "mlp_bias": False,
    "mlp_hidden_act": "relu2", "model_type": "nemotron_h", "moe_intermediate_size": 1856,
    "moe_shared_expert_intermediate_size": 3712, "n_group": 1, "n_groups": 8, "n_routed_experts": 128,
    "n_shared_experts": 1, "norm_eps": 1e-05, "norm_topk_prob": True, "num_attention_heads": 32,
    "num_experts_per_tok": 6, "num_hidden_layers": 52, "num_key_value_heads": 2, "routed_scaling_factor": 2.5,
    "ssm_state_size": 128, "tie_word_embeddings": False, "time_step_limit": [0.0, float("inf")],
    "time_step_max": 0.1, "time_step_min": 0.001, "topk_group": 1, "torch_dtype": "bfloat16", "use_bias": False,
    "use_conv_bias": True, "vocab_size": 131072,
}
# Every block kind: Mamba, MoE, attention, MLP, twice over, two mixers in a row and two MLP blocks in a row
TINY_PATTERN = "ME*-M*EE-M"
TINY = dict(
    vocab_size=300, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_num_heads=8,
    mamba_head_dim=8, n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=16, intermediate_size=48,
    moe_intermediate_size=32, moe_shared_expert_intermediate_size=40, n_routed_experts=8, num_experts_per_tok=3,
    n_group=2, topk_group=1, routed_scaling_factor=2.5, max_position_embeddings=1024, initializer_range=0.08,
)


def randomize_mamba(model: Any, seed: int) -> None:
    """transformers inits A_log = log(1..H), D = 1, dt_bias = 1, norm weights 1 and correction biases 0: give them
    spread values, so a norm or skip that ignored its weight, or a bias applied to the wrong thing, is caught."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            r = torch.randn(t.shape, generator=g)
            if name.endswith("e_score_correction_bias"):
                t.copy_(0.1 * r)
            elif name.endswith(("norm.weight", "norm_f.weight", ".D")):
                t.copy_(1 + 0.2 * r)
            elif name.endswith("dt_bias"):
                t.copy_(-3 + 0.5 * r)  # softplus(dt) ~ 0.05: the published checkpoints' range
            elif name.endswith("A_log"):
                t.copy_(torch.log(torch.rand(t.shape, generator=g) * 15 + 1))


def write_nemotron_h(folder: Path, dtype: torch.dtype = torch.float32, seed: int = 0, **fields: Any) -> Path:
    from transformers import NemotronHConfig, NemotronHForCausalLM

    config = NemotronHConfig(**{"hybrid_override_pattern": TINY_PATTERN, **TINY, **fields})
    torch.manual_seed(seed)
    model = NemotronHForCausalLM(config).to(dtype).eval()
    randomize_mamba(model, seed)
    model.save_pretrained(folder)
    return folder


def write_nano_real_dims(folder: Path, pattern: str = "MEM*E-", experts: int = 12, **fields: Any) -> Path:
    """Nemotron-3-Nano-30B-A3B's dimensions with `pattern` for layers and `experts` of its 128 experts (top-6
    kept), a 4096-token vocabulary; random init, bf16."""
    real = {k: v for k, v in NEMOTRON_3_NANO.items()
            if k not in ("architectures", "model_type", "torch_dtype", "num_hidden_layers", "hybrid_override_pattern",
                         "time_step_limit")}
    return write_nemotron_h(folder, torch.bfloat16, **{**real, "hybrid_override_pattern": pattern,
                                                       "n_routed_experts": experts, "vocab_size": 4096,
                                                       "max_position_embeddings": 4096, "initializer_range": 0.02,
                                                       **fields})
