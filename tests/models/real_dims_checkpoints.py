"""Checkpoints of the hybrid and MLA architectures at the real dimensions of their published configs, truncated.

Written by transformers' own `save_pretrained` on a random-init model (the independent reference), in bf16, like
tests/real_dims.py (which holds the older architectures and GLM-4.5-Air). Hidden sizes, head counts and dims,
linear-attention / Mamba shapes and expert widths are the published ones (tests/data/reference_configs); cut to keep
CI in budget: the layer count (keeping the layer-kind pattern), the expert count (top-k plus a few), the vocabulary
(4096). Correction biases and zero-centred norm weights (zero at init) are randomized so they are tested.

| name | layers kept | experts |
|---|---|---|
| Qwen3-Next-80B-A3B | 4: 3 Gated DeltaNet + 1 gated full attention | 12 of 512 (top-10) |
| Qwen3.5-35B-A3B | 4: 3 Gated DeltaNet + 1 gated full attention (a tiny vision tower beside) | 12 of 256 (top-8) |
| Nemotron-3-Nano-30B-A3B | 6: MEM*E- (Mamba, MoE, attention, MLP) | 8 of 128 (top-6) |
| DeepSeek-V3 | 2: first_k_dense_replace 1 (the real 18432-wide dense MLP, then MoE) | 16 of 256 in 8 groups (top-8) |
| GLM-4.5-Air | 2: one dense, one MoE with its shared expert (tests/real_dims.py) | 10 of 128 (top-8) |
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tests.models.checkpoints import randomize_zero_inits

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "reference_configs"  # copies of shared/reference/configs
VOCAB = 4096
# the fields of a published config.json that describe the file, not the model's dimensions
NOT_DIMS = ("architectures", "model_type", "torch_dtype", "dtype", "rope_scaling", "eos_token_id", "bos_token_id",
            "pad_token_id", "quantization_config", "auto_map", "transformers_version", "_source", "_note")


def published(name: str) -> dict[str, Any]:
    """`name`'s config.json (tests/data/reference_configs) without the fields of NOT_DIMS."""
    config = json.loads((CONFIGS / f"{name}.json").read_text())
    return {k: v for k, v in config.items() if k not in NOT_DIMS}


def _save(model: Any, folder: Path) -> Path:
    randomize_zero_inits(model)
    model.save_pretrained(folder)
    return folder


def write_qwen3_next(folder: Path, seed: int = 0) -> Path:
    """Qwen3-Next-80B-A3B: 4 layers (3 Gated DeltaNet + 1 gated full attention), 12 of its 512 experts (top-10)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {**published("Qwen3-Next-80B-A3B"), "num_hidden_layers": 4, "num_experts": 12, "vocab_size": VOCAB,
              "max_position_embeddings": 4096, "initializer_range": 0.04}
    fields.pop("layer_types", None)
    config = AutoConfig.for_model("qwen3_next", **fields)
    torch.manual_seed(seed)
    return _save(AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16), folder)


def write_qwen35(folder: Path, seed: int = 0) -> Path:
    """Qwen3.5-35B-A3B (Qwen3_5MoeForConditionalGeneration, the language model under model.language_model.*): the
    published text_config cut to 4 layers (3 Gated DeltaNet + 1 gated full attention, the published pattern's first
    period), 12 of its 256 experts (top-8); a tiny vision tower (never loaded by the engine)."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    text = json.loads((CONFIGS / "Qwen3.5-35B-A3B.json").read_text())["text_config"]
    text = {k: v for k, v in text.items() if k not in NOT_DIMS}
    text |= {"num_hidden_layers": 4, "layer_types": text["layer_types"][:4], "num_experts": 12, "vocab_size": VOCAB,
             "max_position_embeddings": 4096, "initializer_range": 0.04}
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"])
    config = Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return _save(Qwen3_5MoeForConditionalGeneration(config).to(torch.bfloat16).eval(), folder)


def write_nemotron_nano(folder: Path, seed: int = 0) -> Path:
    """Nemotron-3-Nano-30B-A3B: 6 layers MEM*E- (every block kind), 8 of its 128 experts (top-6)."""
    from tests.models.nemotron_h_checkpoints import write_nano_real_dims

    return write_nano_real_dims(folder, experts=8, seed=seed)


# DeepSeek-V3's published dimensions with its yarn rope; 2 layers (first_k_dense_replace 1: one dense layer with the
# real 18432-wide MLP, one MoE layer), 16 of the 256 routed experts (n_group 8 of 2 experts each, topk_group 4,
# top-8: the group rule still decides), vocabulary 4096
DEEPSEEK_V3 = dict(
    hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_attention_heads=128,
    num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, n_routed_experts=16, n_group=8, topk_group=4, num_experts_per_tok=8, n_shared_experts=1,
    first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, rms_norm_eps=1e-6, num_hidden_layers=2,
    vocab_size=VOCAB, max_position_embeddings=4096, initializer_range=0.04,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0},
)


def write_deepseek_v3(folder: Path, seed: int = 0) -> Path:
    """DeepSeek-V3 (DEEPSEEK_V3): about 3.1 GB in bf16."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model("deepseek_v3", **DEEPSEEK_V3)
    return _save(AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16), folder)


def write_glm45_air(folder: Path, seed: int = 0) -> Path:
    """GLM-4.5-Air (tests/real_dims.py): one dense layer, one MoE layer with its shared expert, 10 of 128 experts."""
    from tests.real_dims import write_real_dims

    return write_real_dims(folder, "GLM-4.5-Air", seed=seed)


BUILDERS: dict[str, Callable[[Path], Path]] = {
    "Qwen3-Next-80B-A3B": write_qwen3_next,
    "Qwen3.5-35B-A3B": write_qwen35,
    "Nemotron-3-Nano-30B-A3B": write_nemotron_nano,
    "DeepSeek-V3": write_deepseek_v3,
    "GLM-4.5-Air": write_glm45_air,
}
