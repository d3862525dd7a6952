"""Architecture registry: config.json "architectures" -> an `Architecture` (spec reader + checkpoint names).

An architecture is data, not a model class: it turns config.json into a `ModelSpec` and says where each weight
lives in the checkpoint. All architectures share one set of layers (`moeserve.models.layers.base`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from moeserve.errors import UnsupportedModelError
from moeserve.models.spec import ModelSpec


@dataclass(frozen=True)
class WeightNames:
    """Checkpoint tensor names. `{L}` is the layer index, `{E}` the expert index.

    Linear entries are prefixes (``...q_proj``): the loader appends ``.weight`` / ``.bias`` (or the tensors of
    a quantized format). Expert entries are templates of per-expert Linears.
    """

    embed: str = "model.embed_tokens.weight"
    final_norm: str = "model.norm.weight"
    lm_head: str = "lm_head"
    input_norm: str = "model.layers.{L}.input_layernorm.weight"
    post_norm: str = "model.layers.{L}.post_attention_layernorm.weight"
    q_proj: str = "model.layers.{L}.self_attn.q_proj"
    k_proj: str = "model.layers.{L}.self_attn.k_proj"
    v_proj: str = "model.layers.{L}.self_attn.v_proj"
    o_proj: str = "model.layers.{L}.self_attn.o_proj"
    q_norm: str = "model.layers.{L}.self_attn.q_norm.weight"
    k_norm: str = "model.layers.{L}.self_attn.k_norm.weight"
    sinks: str = "model.layers.{L}.self_attn.sinks"
    router: str = "model.layers.{L}.mlp.gate"
    router_correction_bias: str = "model.layers.{L}.mlp.gate.e_score_correction_bias"  # noaux_tc routing, fp32 [E]
    # routing "normed_softmax_topk" (MoeSpec.expert_scales): the router input's scale [H], the per-expert scales [E]
    router_scale: str = "model.layers.{L}.mlp.gate.scale"
    router_expert_scale: str = "model.layers.{L}.mlp.gate.per_expert_scale"
    expert_gate: str = "model.layers.{L}.mlp.experts.{E}.gate_proj"
    expert_up: str = "model.layers.{L}.mlp.experts.{E}.up_proj"
    expert_down: str = "model.layers.{L}.mlp.experts.{E}.down_proj"
    dense_gate: str = "model.layers.{L}.mlp.gate_proj"
    dense_up: str = "model.layers.{L}.mlp.up_proj"
    dense_down: str = "model.layers.{L}.mlp.down_proj"
    shared_gate: str = "model.layers.{L}.mlp.shared_expert.gate_proj"
    shared_up: str = "model.layers.{L}.mlp.shared_expert.up_proj"
    shared_down: str = "model.layers.{L}.mlp.shared_expert.down_proj"
    shared_expert_gate: str = "model.layers.{L}.mlp.shared_expert_gate"
    # Experts stacked along dim 0 in one tensor per projection (gpt-oss): prefixes, biases are `<prefix>_bias`.
    stacked_gate_up: str = "model.layers.{L}.mlp.experts.gate_up_proj"
    stacked_down: str = "model.layers.{L}.mlp.experts.down_proj"
    # Gated DeltaNet linear attention (ModelSpec.linear_attention): Qwen3-Next's two input projections or Qwen3.5's
    # four (LinearAttentionSpec.projections), the conv, decay and norm parameters, the output projection
    linear_qkvz: str = "model.layers.{L}.linear_attn.in_proj_qkvz"
    linear_ba: str = "model.layers.{L}.linear_attn.in_proj_ba"
    linear_qkv: str = "model.layers.{L}.linear_attn.in_proj_qkv"
    linear_z: str = "model.layers.{L}.linear_attn.in_proj_z"
    linear_b: str = "model.layers.{L}.linear_attn.in_proj_b"
    linear_a: str = "model.layers.{L}.linear_attn.in_proj_a"
    linear_conv: str = "model.layers.{L}.linear_attn.conv1d.weight"
    linear_a_log: str = "model.layers.{L}.linear_attn.A_log"
    linear_dt_bias: str = "model.layers.{L}.linear_attn.dt_bias"
    linear_norm: str = "model.layers.{L}.linear_attn.norm.weight"
    linear_out: str = "model.layers.{L}.linear_attn.out_proj"
    # Multi-head latent attention (ModelSpec.mla): the query's low-rank pair and its norm (q_proj when there is no
    # q_lora_rank), the latent's down projection (with the shared rotated key), its norm and its up projection
    mla_q_a: str = "model.layers.{L}.self_attn.q_a_proj"
    mla_q_a_norm: str = "model.layers.{L}.self_attn.q_a_layernorm.weight"
    mla_q_b: str = "model.layers.{L}.self_attn.q_b_proj"
    mla_kv_a: str = "model.layers.{L}.self_attn.kv_a_proj_with_mqa"
    mla_kv_a_norm: str = "model.layers.{L}.self_attn.kv_a_layernorm.weight"
    mla_kv_b: str = "model.layers.{L}.self_attn.kv_b_proj"
    # DeepSeek Sparse Attention's lightning indexer (MlaSpec.indexer): its query and key projections (Linears), the
    # key's LayerNorm (weight and bias) and the per-head weights (fp32) - prefixes
    indexer_wq_b: str = "model.layers.{L}.self_attn.indexer.wq_b"
    indexer_wk: str = "model.layers.{L}.self_attn.indexer.wk"
    indexer_k_norm: str = "model.layers.{L}.self_attn.indexer.k_norm"
    indexer_weights: str = "model.layers.{L}.self_attn.indexer.weights_proj"
    # Mamba-2 mixers (ModelSpec.mamba): in_proj (z, x/B/C, dt), the depthwise conv and its bias, A_log, D, dt_bias,
    # the gated RMSNorm, out_proj
    mamba_in: str = "backbone.layers.{L}.mixer.in_proj"
    mamba_conv: str = "backbone.layers.{L}.mixer.conv1d.weight"
    mamba_conv_bias: str = "backbone.layers.{L}.mixer.conv1d.bias"
    mamba_a_log: str = "backbone.layers.{L}.mixer.A_log"
    mamba_d: str = "backbone.layers.{L}.mixer.D"
    mamba_dt_bias: str = "backbone.layers.{L}.mixer.dt_bias"
    mamba_norm: str = "backbone.layers.{L}.mixer.norm.weight"
    mamba_out: str = "backbone.layers.{L}.mixer.out_proj"
    # Hyper-connections (ModelSpec.hyper): the gated residuals before each layer's mixer and MLP and before the LM
    # head (prefixes of hc_norm.weight, input_mix_weight_down, input_mix_weight_up, block_inject_weight)
    hc_attn: str = "model.layers.{L}.attn_hyper_connection"
    hc_mlp: str = "model.layers.{L}.mlp_hyper_connection"
    hc_final: str = "model.hyper_connection_mixer"
    # The n-gram per-layer embedding (ModelSpec.ngram) and the sparse-attention indexer (ModelSpec.qsa): prefixes
    ple: str = "model.layers.{L}.ple"
    indexer: str = "model.layers.{L}.self_attn.indexer"
    # DeepSeek-V4 (ModelSpec.compressed, .mhc, MoeSpec.hash_layers): the attention block (prefix of wq_a, wkv, wo_a,
    # attn_sink, compressor.*, indexer.* ...), the hyper-connections before each mixer, each MLP and the head
    # (prefixes of <prefix>_fn, _base, _scale), the hash layers' token -> experts table
    compressed_attn: str = "model.layers.{L}.attn"
    mhc_attn: str = "model.layers.{L}.hc_attn"
    mhc_mlp: str = "model.layers.{L}.hc_ffn"
    mhc_head: str = "model.hc_head.hc"
    router_hash: str = "model.layers.{L}.ffn.gate.tid2eid"
    # Sandwich layers (ModelSpec.sandwich): post_norm normalises the attention's output; the MLP part's norms (before
    # and after it; after the dense MLP and after the experts, before the experts), the layer's output scale [1]
    pre_mlp_norm: str = "model.layers.{L}.pre_feedforward_layernorm.weight"
    post_mlp_norm: str = "model.layers.{L}.post_feedforward_layernorm.weight"
    post_dense_norm: str = "model.layers.{L}.post_feedforward_layernorm_1.weight"
    post_moe_norm: str = "model.layers.{L}.post_feedforward_layernorm_2.weight"
    pre_moe_norm: str = "model.layers.{L}.pre_feedforward_layernorm_2.weight"
    layer_scalar: str = "model.layers.{L}.layer_scalar"


class Architecture(ABC):
    """One model family as config.json names it (e.g. "Qwen3MoeForCausalLM")."""

    name: ClassVar[str]
    names: ClassVar[WeightNames] = WeightNames()
    # Checkpoint tensors not served, by name prefix, and why (a vision tower, multi-token-prediction layers): never
    # read, counted in no resident size, named in the start-up log (models/validate.py is_skipped)
    unserved: ClassVar[tuple[tuple[str, str], ...]] = ()

    @abstractmethod
    def spec(self, config: dict[str, Any], where: str) -> ModelSpec:
        """Read config.json into a ModelSpec; raise CheckpointError naming `where` on invalid values."""


_REGISTRY: dict[str, Architecture] = {}

# Architectures transformers implements that are not served yet, and what they need beyond the registered families:
# refused in one line that says so (a config of one is sized by no spec either)
NOT_YET_SERVED: dict[str, str] = {}


def register(cls: type[Architecture]) -> type[Architecture]:
    """Class decorator adding an architecture to the registry under its config.json name."""
    _REGISTRY[cls.name] = cls()
    return cls


def supported_architectures() -> list[str]:
    _load_all()
    return sorted(_REGISTRY)


def get_architecture(config: dict[str, Any], where: str) -> Architecture:
    """The registered architecture named by config.json "architectures" (first match)."""
    _load_all()
    names = config.get("architectures") or []
    if not isinstance(names, list) or not names:
        raise UnsupportedModelError(
            f"{where}: no 'architectures' entry; supported: {', '.join(sorted(_REGISTRY))}"
        )
    for name in names:
        if name in _REGISTRY:
            return _REGISTRY[name]
    for name in names:
        if name in NOT_YET_SERVED:
            raise UnsupportedModelError(f"{where}: architecture {name} is not served yet: it needs "
                                        f"{NOT_YET_SERVED[name]}; supported: {', '.join(sorted(_REGISTRY))}")
    raise UnsupportedModelError(
        f"{where}: architecture {', '.join(map(str, names))} is not supported; "
        f"supported: {', '.join(sorted(_REGISTRY))}"
    )


def _load_all() -> None:
    # Importing the family modules runs their @register decorators.
    from moeserve.models import archs  # noqa: F401
