"""Benchmark shapes of the hybrid and latent-attention architectures: a Qwen3.5-like Gated DeltaNet hybrid
(qwen3_next), a DeepSeek-V3-like MLA model (deepseek_v3) and a Nemotron-H-like Mamba-2 hybrid (nemotron_h).

Each is a published config with its dimensions scaled to this machine (24 GiB, 2 cores: ~2 GB in bf16 like the
Qwen3-MoE "small" shape), the ratios that set a decode step's traffic kept (linear : full attention layers, the
latent width, experts : active experts, a shared expert), plus a "-tiny" variant for tests. The tensor list is the
one moeserve's loader checks a real checkpoint of the architecture against (models/validate.expected_tensors and
the expert kind's list, as `moeserve plan` sizes a config alone: models/config_only.py);
tests/bench/test_arch_shapes.py checks it against the model transformers builds from the same config.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any

from moeserve.bench.shape_base import Shape, Tensors, numel


class ArchShape(Shape):
    """A shape given by its config.json; everything else read from it through moeserve's architecture registry."""

    def __init__(self, name: str, purpose: str, config: dict[str, Any]) -> None:
        self.name, self.purpose, self._config = name, purpose, config
        self.router_correlation = 0.0
        spec = self.spec()
        self.hidden_size, self.vocab_size, self.num_layers = spec.hidden_size, spec.vocab_size, spec.num_layers
        self.num_experts, self.top_k = spec.moe.num_experts, spec.moe.top_k
        self.max_position_embeddings = spec.max_position_embeddings

    def __repr__(self) -> str:  # the synthetic checkpoint's cache marker: changes with any config field
        return f"ArchShape({self.name!r}, {sorted(self._config.items())!r})"

    def hf_config(self, dtype: str = "bfloat16") -> dict[str, Any]:
        return {**self._config, "dtype": dtype, "torch_dtype": dtype}

    @cached_property
    def _tensors(self) -> tuple[dict[int | None, Tensors], frozenset[str], int]:
        """Tensors by layer (None: outside the layers), those stored in fp32, parameters of one expert."""
        from moeserve.checkpoint.folder import Checkpoint
        from moeserve.models import config_only
        from moeserve.models.registry import get_architecture
        from moeserve.models.validate import expected_tensors, layer_of

        config = self.hf_config()
        arch = get_architecture(config, self.name)
        spec = arch.spec(config, self.name)
        empty = Checkpoint(path=Path(self.name), config=config, generation_config={}, tensors={})
        experts = list(config_only.EXPERT_TENSORS[spec.moe.expert_kind](arch, spec, config_only.QuantScheme("none")))
        by_layer: dict[int | None, Tensors] = {}
        for name, shape, is_linear in [*expected_tensors(empty, arch, spec), *experts]:
            name = name + ".weight" if is_linear else name  # a Linear is named by its module
            by_layer.setdefault(layer_of(arch, name), []).append((name, tuple(shape)))
        one_expert = sum(numel(tuple(s)) for _, s, _ in experts) // (len(spec.moe_layer_ids) * spec.moe.num_experts)
        return by_layer, frozenset(config_only._stored_in_fp32(arch, spec)), one_expert

    def layer_tensors(self, layer: int) -> Tensors:
        return self._tensors[0][layer]

    def outer_tensors(self) -> Tensors:
        return self._tensors[0][None]

    def fp32_tensors(self) -> frozenset[str]:
        return self._tensors[1]

    @property
    def expert_params(self) -> int:
        return self._tensors[2]

    @property
    def moe_layer_count(self) -> int:
        return len(self.spec().moe_layer_ids)

    @property
    def embedding_name(self) -> str:
        from moeserve.models.registry import get_architecture

        return get_architecture(self._config, self.name).names.embed


def _common(hidden: int, layers: int, experts: int, inter: int, top_k: int, vocab: int) -> dict[str, Any]:
    return {"hidden_size": hidden, "num_hidden_layers": layers, "moe_intermediate_size": inter,
            "num_experts_per_tok": top_k, "vocab_size": vocab, "max_position_embeddings": 4096,
            "tie_word_embeddings": False, "initializer_range": 0.02, "bos_token_id": 1, "eos_token_id": 2,
            "use_cache": True, "attention_bias": False, "attention_dropout": 0.0, "hidden_act": "silu",
            "n_routed_experts" if experts < 0 else "num_experts": abs(experts)}


def qwen3_next_config(hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, k_heads: int,
                      v_heads: int, linear_dim: int, experts: int, inter: int, top_k: int, vocab: int) -> dict[str, Any]:
    """Qwen3-Next / Qwen3.5 text model: 3 Gated DeltaNet layers to 1 gated full-attention layer (partial rotary
    0.25, per-head q/k norms), a sigmoid-gated shared expert of the routed experts' width."""
    return {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
            **_common(hidden, layers, experts, inter, top_k, vocab),
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
            "full_attention_interval": 4, "partial_rotary_factor": 0.25, "linear_conv_kernel_dim": 4,
            "linear_num_key_heads": k_heads, "linear_num_value_heads": v_heads, "linear_key_head_dim": linear_dim,
            "linear_value_head_dim": linear_dim, "shared_expert_intermediate_size": inter,
            "intermediate_size": 4 * inter, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
            "rms_norm_eps": 1e-6, "rope_theta": 10000000.0, "rope_scaling": None, "use_sliding_window": False,
            "router_aux_loss_coef": 0.001, "output_router_logits": False}


def deepseek_v3_config(hidden: int, layers: int, heads: int, q_lora: int, kv_lora: int, rope: int, nope: int,
                       experts: int, groups: tuple[int, int], inter: int, top_k: int, vocab: int) -> dict[str, Any]:
    """DeepSeek-V3: MLA in every layer (latent kv_lora + rope values cached per token), noaux_tc routing
    (sigmoid, correction bias, groups, routed_scaling_factor 2.5), one shared expert, the first layer dense."""
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
            **_common(hidden, layers, -experts, inter, top_k, vocab),
            "num_attention_heads": heads, "num_key_value_heads": heads, "q_lora_rank": q_lora,
            "kv_lora_rank": kv_lora, "qk_rope_head_dim": rope, "qk_nope_head_dim": nope, "v_head_dim": nope,
            "n_group": groups[0], "topk_group": groups[1], "n_shared_experts": 1, "routed_scaling_factor": 2.5,
            "first_k_dense_replace": 1, "moe_layer_freq": 1, "intermediate_size": 4 * inter, "norm_topk_prob": True,
            "scoring_func": "sigmoid", "topk_method": "noaux_tc", "num_nextn_predict_layers": 0, "ep_size": 1,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None, "rope_interleave": True}


def nemotron_h_config(hidden: int, pattern: str, heads: int, kv_heads: int, mamba_heads: int, experts: int,
                      inter: int, top_k: int, vocab: int) -> dict[str, Any]:
    """Nemotron-H: Mamba-2 (M), MoE (E) and attention (*) blocks; relu2 experts, a relu2 shared expert twice the
    experts' width, sigmoid routing with a correction bias."""
    return {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
            **_common(hidden, len(pattern), -experts, inter, top_k, vocab),
            "hybrid_override_pattern": pattern, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "head_dim": hidden // heads, "mamba_num_heads": mamba_heads, "mamba_head_dim": 2 * hidden // mamba_heads,
            "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4, "expand": 2, "chunk_size": 128,
            "use_conv_bias": True, "mamba_proj_bias": False, "mamba_hidden_act": "silu", "mlp_hidden_act": "relu2",
            "moe_shared_expert_intermediate_size": 2 * inter, "intermediate_size": inter, "n_shared_experts": 1,
            "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
            "layer_norm_epsilon": 1e-5, "norm_eps": 1e-5, "mlp_bias": False, "use_bias": False,
            "residual_in_fp32": False, "rescale_prenorm_residual": True, "partial_rotary_factor": 1.0,
            "rope_theta": 10000.0, "sliding_window": None, "num_logits_to_keep": 1, "pad_token_id": 0,
            "time_step_floor": 0.0001, "time_step_max": 0.1, "time_step_min": 0.001, "use_mamba_kernels": False}


def _shapes() -> dict[str, ArchShape]:
    made = [
        # Qwen3.5-35B-A3B / Qwen3-Next: hidden 2048, 16 q / 2 kv heads of 256, linear 16 k / 32 v heads of 128,
        # 256-512 experts of 512, top 8-10, shared 512. Here half the hidden and heads, 32 experts top 4.
        ArchShape("hybrid", "Qwen3.5-like Gated DeltaNet hybrid, 12 linear + 4 full layers (~2.1 GB bf16)",
                  qwen3_next_config(1024, 16, 8, 2, 256, 8, 16, 128, 32, 512, 4, 32000)),
        ArchShape("hybrid-tiny", "Qwen3.5-like hybrid for tests (3 linear + 1 full layer)",
                  qwen3_next_config(64, 4, 4, 2, 16, 2, 4, 16, 8, 32, 2, 256)),
        # DeepSeek-V3: kv_lora_rank 512 + rope 64 (kept), q_lora 1536, 128 heads of 128+64, 256 experts top 8 in
        # 8 groups (top 4 groups), first 3 of 61 layers dense. Here 16 heads, q_lora 512, 32 experts top 4.
        ArchShape("mla", "DeepSeek-V3-like MLA, latent 512 + rope 64, noaux_tc, 1 dense + 15 MoE layers (~1.9 GB)",
                  deepseek_v3_config(1024, 16, 16, 512, 512, 64, 128, 32, (4, 2), 512, 4, 32000)),
        ArchShape("mla-tiny", "DeepSeek-V3-like MLA for tests (1 dense + 2 MoE layers)",
                  deepseek_v3_config(64, 3, 4, 32, 32, 16, 16, 8, (4, 2), 32, 2, 256)),
        # Nemotron-3-Nano: hidden 2688, 52 blocks MEMEM*E..., 64 Mamba heads of 64, 32 q / 2 kv heads,
        # 128 relu2 experts of 1856 top 6, shared 3712. Here 24 blocks, 32 experts of 768 top 4.
        ArchShape("mamba-hybrid", "Nemotron-H-like Mamba-2 hybrid, 10 M + 10 E + 4 attention blocks (~1.9 GB)",
                  nemotron_h_config(1024, "MEMEM*EMEM*EMEMEM*EMEM*E", 16, 2, 32, 32, 768, 4, 32000)),
        ArchShape("mamba-hybrid-tiny", "Nemotron-H-like hybrid for tests (M E M * E)",
                  nemotron_h_config(64, "MEM*E", 4, 2, 8, 8, 32, 2, 256)),
    ]
    return {s.name: s for s in made}


ARCH_SHAPES: dict[str, ArchShape] = _shapes()
