"""Named synthetic benchmark shapes: models with random weights, sized for a purpose.

A shape knows its Hugging Face config and every tensor name and shape of the checkpoint it implies, so the
synthetic writer, the ceiling arithmetic and the peers all agree on one description of the model
(shape_base.Shape). Here: the Qwen3-MoE shapes (BenchShape) and the registry of all of them; the hybrid, MLA
and Mamba-2 shapes are in arch_shapes.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moeserve.bench.arch_shapes import ARCH_SHAPES
from moeserve.bench.shape_base import Shape
from moeserve.errors import ConfigError


@dataclass(frozen=True)
class BenchShape(Shape):
    """A Qwen3-MoE shape (every layer sparse, untied head, per-head q/k norm)."""

    name: str
    hidden_size: int
    num_layers: int
    num_experts: int
    moe_intermediate_size: int
    top_k: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 4096
    purpose: str = ""
    # Each MoE router = sqrt(c) x one router shared by all layers + sqrt(1 - c) x its own (the same variance), so
    # consecutive layers pick alike, as the routing of trained MoEs correlates across layers (the FLAME-MoE trace,
    # docs/policies.md): the case a cross-layer predictor (prefetch) is for. 0 = independent routers.
    router_correlation: float = 0.0

    def hf_config(self, dtype: str = "bfloat16") -> dict[str, Any]:
        """config.json as transformers writes it for Qwen3MoeForCausalLM."""
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "hidden_size": self.hidden_size,
            "intermediate_size": 4 * self.moe_intermediate_size,  # dense MLP size (unused: every layer is MoE)
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.top_k,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "attention_bias": False,
            "attention_dropout": 0.0,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "use_cache": True,
            "output_router_logits": False,
            "router_aux_loss_coef": 0.001,
            "initializer_range": 0.02,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "dtype": dtype,
        }

    # ------------------------------------------------------------------------------------------ tensors
    def layer_tensors(self, layer: int) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every tensor of decoder layer `layer`, experts last."""
        h, d, i = self.hidden_size, self.head_dim, self.moe_intermediate_size
        p = f"model.layers.{layer}."
        out: list[tuple[str, tuple[int, ...]]] = [
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (self.num_heads * d, h)),
            (p + "self_attn.k_proj.weight", (self.num_kv_heads * d, h)),
            (p + "self_attn.v_proj.weight", (self.num_kv_heads * d, h)),
            (p + "self_attn.o_proj.weight", (h, self.num_heads * d)),
            (p + "self_attn.q_norm.weight", (d,)),
            (p + "self_attn.k_norm.weight", (d,)),
            (p + "mlp.gate.weight", (self.num_experts, h)),
        ]
        for e in range(self.num_experts):
            q = f"{p}mlp.experts.{e}."
            out += [(q + "gate_proj.weight", (i, h)), (q + "up_proj.weight", (i, h)), (q + "down_proj.weight", (h, i))]
        return out

    def outer_tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """Embeddings, final norm and LM head."""
        v, h = self.vocab_size, self.hidden_size
        return [("model.embed_tokens.weight", (v, h)), ("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]

    # ------------------------------------------------------------------------------------ element counts
    @property
    def expert_params(self) -> int:
        """Parameters of one expert (gate, up, down)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def attention_params(self) -> int:
        """Parameters of one layer's attention projections (norm vectors excluded)."""
        h, d = self.hidden_size, self.head_dim
        return h * d * (2 * self.num_heads + 2 * self.num_kv_heads)

    @property
    def layer_dense_params(self) -> int:
        """Per-layer parameters that every token reads: attention, router, norms."""
        return self.attention_params + self.num_experts * self.hidden_size + 2 * self.hidden_size + 2 * self.head_dim

    def dense_bytes_int8(self, batch: int = 1) -> int:
        """The attention projections and the LM head as int8 codes (1 byte per weight) plus a float32 scale per
        output row; routers, norms, the final norm and the embedding rows in bf16 (moeserve keeps them so, see
        moeserve.models.model.build_model)."""
        h, d = self.hidden_size, self.head_dim
        attn_rows = (self.num_heads + 2 * self.num_kv_heads) * d + h  # q/k/v stacked, then o_proj
        int8_layer = self.attention_params + 4 * attn_rows
        bf16_layer = 2 * (self.layer_dense_params - self.attention_params)  # router + norm vectors
        head = self.vocab_size * h + 4 * self.vocab_size
        return self.num_layers * (int8_layer + bf16_layer) + head + 2 * h + 2 * batch * h

    @property
    def moe_layer_count(self) -> int:
        return self.num_layers  # every layer sparse

    @property
    def embedding_name(self) -> str:
        return "model.embed_tokens.weight"


# The shapes `moeserve bench --shape` accepts. "small" is the reference model (~1.8 GB in bf16);
# "large" has ~7 GB of experts, several times the expert cache the benchmark gives it by default.
_QWEN3_MOE: dict[str, Shape] = {
    s.name: s
    for s in (
        BenchShape("tiny", hidden_size=64, num_layers=2, num_experts=8, moe_intermediate_size=32, top_k=2,
                   vocab_size=256, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512,
                   purpose="CI smoke test (~0.2 MB)"),
        BenchShape("small", hidden_size=1024, num_layers=16, num_experts=32, moe_intermediate_size=512, top_k=4,
                   vocab_size=32000, num_heads=16, num_kv_heads=4, head_dim=64,
                   purpose="resident decode (~1.8 GB bf16)"),
        BenchShape("large", hidden_size=1536, num_layers=24, num_experts=64, moe_intermediate_size=512, top_k=4,
                   vocab_size=32000, num_heads=24, num_kv_heads=4, head_dim=64,
                   purpose="offloaded decode (~7.5 GB bf16, experts >= 4x the default bench cache)"),
        BenchShape("large-affine", hidden_size=1536, num_layers=24, num_experts=64, moe_intermediate_size=512,
                   top_k=4, vocab_size=32000, num_heads=24, num_kv_heads=4, head_dim=64, router_correlation=0.9,
                   purpose="'large' with routers correlated across layers (0.9): prefetch's case"),
    )
}
SHAPES: dict[str, Shape] = {**_QWEN3_MOE, **ARCH_SHAPES}

# Expert cache the benchmark gives each shape unless --expert-cache-gb says otherwise (None = all resident).
DEFAULT_EXPERT_CACHE_GB: dict[str, float | None] = {"tiny": None, "small": None, "large": 1.5, "large-affine": 1.5} | {
    name: None for name in ARCH_SHAPES}


def get_shape(name: str) -> Shape:
    """The named shape, or ConfigError listing the valid names."""
    try:
        return SHAPES[name]
    except KeyError:
        from moeserve.config import did_you_mean

        raise ConfigError(f"unknown benchmark shape '{name}'{did_you_mean(name, list(SHAPES))}") from None
