"""ModelSpec: everything the engine needs to know about a model, read once from config.json.

Architectures differ in a handful of switches (q/k norm kind, biases, router rule, shared expert, which layers
are dense); they all become fields of one frozen spec so the shared layers never branch on the model type.
"""

from __future__ import annotations

import builtins
import math
from dataclasses import dataclass
from typing import Any, Literal

from moeserve.errors import CheckpointError

QKNorm = Literal["none", "per_head", "full"]
# How router logits become (weights, ids):
#   softmax_topk: softmax over all experts in fp32, then top-k (optionally renormalised) - Qwen, Mixtral, OLMoE
#   topk_softmax: top-k of the raw logits, then softmax over the k selected - gpt-oss
#   sigmoid_groups: DeepSeek-V3's "noaux_tc": sigmoid scores in fp32; the choice adds a correction bias and keeps the
#                   best topk_group of n_group expert groups (a group's score: the sum of its top 2); the weights are
#                   the unbiased scores of the chosen, optionally renormalised, times routed_scaling_factor - GLM-4.5
#   sqrtsoftplus:   DeepSeek-V4: scores sqrt(softplus(logits)) in the router's dtype; the choice adds a correction bias and takes the top
#                   k (no groups), or, in MoeSpec.hash_layers, is read from a token-id table; the weights are the scores
#                   of the chosen, renormalised, times routed_scaling_factor
#   normed_softmax_topk: the router reads RMSNorm(x) (no weight) * scale [H] / sqrt(H); softmax_topk renormalised,
#                   each weight times its expert's scale (MoeSpec.expert_scales) - Gemma-4
Routing = Literal["softmax_topk", "topk_softmax", "sigmoid_groups", "sqrtsoftplus", "normed_softmax_topk"]
# relu2: up -> relu(x)^2 -> down, no gate (Nemotron-H); geglu: SwiGLU's form with tanh-approximated GELU for SiLU,
# all experts of a layer stored in one tensor per projection (Gemma-4); swiglu_clamp: SwiGLU with the gate clamped
# from above and up to [-swiglu_limit, swiglu_limit] (DeepSeek-V4)
ExpertKind = Literal["swiglu", "swiglu_clamp", "gpt_oss", "relu2", "geglu"]
# How RMSNorm applies its weight:
#   cast_then_scale: normalise in fp32, cast to the compute dtype, then times the weight (Llama, Qwen, Mixtral)
#   scale_in_fp32:   weight kept in fp32, normalise and scale in fp32, then cast (gpt-oss)
#   zero_centered:   the checkpoint stores w - 1: weight (1 + w) kept in fp32, then as scale_in_fp32 (Qwen3-Next, Qwen3.5)
NormStyle = Literal["cast_then_scale", "scale_in_fp32", "zero_centered"]


@dataclass(frozen=True)
class AttentionSpec:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool
    o_bias: bool
    qk_norm: QKNorm
    clip_qkv: float | None
    sinks: bool
    sliding_window: tuple[int | None, ...]  # per layer; None = full causal attention
    output_gate: bool = False  # q_proj also gives a per-head gate: output * sigmoid(gate) before o_proj (Qwen3-Next)
    scale: float | None = None  # the softmax scale; None: head_dim**-0.5 (Gemma-4: 1, its q/k norms set the scale)
    v_norm: bool = False  # values RMS-normed per head, no weight (Gemma-4)
    k_eq_v: bool = False  # no v_proj: the values are the key projection before its norm and rotary (Gemma-4 global)

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5 if self.scale is None else self.scale


@dataclass(frozen=True)
class LinearAttentionSpec:
    """Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5) in `layers` (the other layers attend in full).
    Per sequence and layer it keeps a recurrent state [v_heads, k_dim, v_dim] and the last conv_kernel - 1 inputs
    of its short causal convolution over q, k and v."""

    layers: tuple[int, ...]
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    # how the checkpoint stores the input projections: "qkvz_ba" (Qwen3-Next: in_proj_qkvz and in_proj_ba, grouped
    # per key head) or "qkv_z_b_a" (Qwen3.5: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, each in plain order)
    projections: Literal["qkvz_ba", "qkv_z_b_a"]

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class MambaSpec:
    """Mamba-2 mixers (Nemotron-H) in `layers`. Per sequence and layer: the last conv_kernel - 1 inputs of the
    causal depthwise conv over x, B and C, and the SSM state [num_heads, head_dim, state_size] (fp32)."""

    layers: tuple[int, ...]
    num_heads: int
    head_dim: int
    n_groups: int  # B and C are shared by num_heads / n_groups heads; the gated RMSNorm normalises per group
    state_size: int
    conv_kernel: int
    conv_bias: bool
    proj_bias: bool
    eps: float  # the gated RMSNorm's
    time_step_min: float  # the prefill scan clamps dt from below to it (transformers' time_step_limit)

    @property
    def inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: x, B and C side by side."""
        return self.inner + 2 * self.n_groups * self.state_size


@dataclass(frozen=True)
class IndexerSpec:
    """DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2, GLM-5): per token one key of head_dim values
    (wk, a LayerNorm, rotary on its first qk_rope_head_dim values), cached beside the latent; per query n_heads
    queries (wq_b of the query's low-rank latent) and n_heads weights (weights_proj, fp32). A query's index score of
    a key is sum_h w_h relu(q_h . k) (scaled); it attends only the `topk` visible keys of highest score."""

    n_heads: int  # index_n_heads
    head_dim: int  # index_head_dim
    topk: int  # index_topk: keys each query attends (all of them while it sees no more)
    interleaved_rope: bool  # GLM-5: DeepSeek's interleaved pairs; DeepSeek-V3.2: half-split
    # GLM-5's "shared" layers (indexer_types): no indexer of their own; they attend the keys the last layer before
    # them with one chose in the same forward
    shared: tuple[int, ...] = ()


@dataclass(frozen=True)
class MlaSpec:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2). Per token the layer caches one latent row:
    kv_lora_rank values (kv_a_proj_with_mqa's first part, RMS-normed) and qk_rope_head_dim rotated key values
    shared by every head; kv_b_proj turns the latent into each head's key (qk_nope_head_dim) and value (v_head_dim).
    The query comes from q_a_proj -> q_a_layernorm -> q_b_proj, or from q_proj when q_lora_rank is None."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    bias: bool  # attention_bias: biases on q_a_proj / q_proj, kv_a_proj_with_mqa and o_proj
    interleaved_rope: bool  # rope_interleave: rotary pairs are (x0, x1), (x2, x3)... (transformers' default)
    softmax_scale: float  # qk_head_dim**-0.5, times yarn's mscale(factor, mscale_all_dim)**2
    indexer: IndexerSpec | None = None  # DeepSeek Sparse Attention: each query attends only the keys it selects

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_width(self) -> int:
        """Values cached per token and layer: the latent and the shared rotated key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class HyperSpec:
    """Hyper-connections (Qwen4-Exp): the residual is `streams` copies of the hidden state side by side
    [N, streams * H]. Before each mixer and each MLP a gated residual (a grouped RMSNorm over each stream, a rank
    `rank` mixer) reads one input from the streams and gives the weights that add the part's output back into each
    stream; a last mixer (no output weights) reads the final hidden state for the LM head (no final norm)."""

    streams: int
    rank: int


@dataclass(frozen=True)
class NgramSpec:
    """The hashed n-gram per-layer embedding (Qwen4-Exp PLE) of linear-attention layers `layers`. Per token and
    layer, each of `heads` hashes of the token's 2..ngram_size-grams picks one row of the layer's table (`rows`
    rows of `head_dim` values: the heads' prime-sized vocabularies `head_vocab_sizes` end to end, padded), stored
    in the checkpoint as `split_parts` equal row blocks. The concatenated rows gate a value into every residual
    stream, followed by a causal depthwise conv of `conv_kernel` taps dilated by ngram_size."""

    layers: tuple[int, ...]  # zero-based layer ids (config.json's ple_layer_ids are one-based)
    embed_dim: int  # heads * head_dim
    ngram_size: int
    heads_per_ngram: int
    conv_kernel: int
    split_parts: int
    seed: int
    eos_token_id: int  # n-grams do not reach across it; positions before the first token read it
    head_vocab_sizes: tuple[tuple[int, ...], ...]  # per PLE layer, per head: a prime
    rows: tuple[int, ...]  # per PLE layer: the table's rows (the vocabularies' sum, padded)

    @property
    def heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.heads

    def table_parameters(self) -> int:
        return sum(self.rows) * self.head_dim


@dataclass(frozen=True)
class QsaSpec:
    """Qwen sparse attention (Qwen4-Exp's indexed attention layers): an indexer of `num_heads` query heads and one
    key head of `head_dim` scores blocks of `compress_ratio` consecutive cached keys (their mean, normed, rotated at
    the block's first position); each query attends the tokens of its `budget // compress_ratio` best complete
    blocks and of its last, incomplete block. Per token and layer it caches one raw index key [head_dim]."""

    num_heads: int
    head_dim: int
    budget: int
    compress_ratio: int


@dataclass(frozen=True)
class CompressedAttentionSpec:
    """DeepSeek-V4's attention (every layer): one shared key=value head of head_dim values per token (kv_proj, its
    norm, rotary on the last rotary dims), attended by num_heads queries (the low-rank q_a -> norm -> q_b, each head
    RMS-normalised) over a sliding window of `window` tokens, with a learned sink per head; the output is rotated
    back and projected in `o_groups` groups to o_lora_rank each, then to hidden (wo_a, wo_b). A layer of ratio r > 0
    also attends compressed entries: each window of r tokens (2r overlapping ones where `indexed`) pooled into one
    head_dim entry by a softmax gate (compressor wkv / wgate / ape / norm); in an `indexed` layer (compressed sparse
    attention) a lightning indexer of its own compressed keys (index_head_dim) picks the index_topk entries each
    query attends. The compressed entries and the indexer's query are rotated with `compress_rope`."""

    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int  # sliding_window: the raw keys every layer attends
    ratios: tuple[int, ...]  # per layer: 0 (sliding window only) or the tokens per compressed entry
    indexed: tuple[bool, ...]  # per layer: compressed sparse attention (an indexer, overlapping windows)
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    compress_rope: RopeSpec  # compressed entries, and the queries of layers with a ratio


@dataclass(frozen=True)
class MhcSpec:
    """Manifold-constrained hyper-connections (DeepSeek-V4): `streams` residual streams [N, streams, H]. Before each
    mixer and each MLP one projection of the normalised streams gives the weights that collapse them into the
    part's input, those that add its output back into each stream, and a streams x streams mixing matrix made
    doubly stochastic by `sinkhorn_iters` Sinkhorn-Knopp steps; a last collapse (the head's) precedes the final
    norm."""

    streams: int
    sinkhorn_iters: int
    eps: float


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    rope_type: str  # "default" | "yarn" | "linear" | "proportional"
    params: tuple[tuple[str, Any], ...] = ()  # the remaining rope_parameters, hashable
    partial_rotary_factor: float = 1.0  # the fraction of head_dim that is rotated (GLM-4.5: 0.5); the rest passes

    def param(self, key: str, default: Any = None) -> Any:
        return dict(self.params).get(key, default)

    def rotary_dim(self, head_dim: int) -> int:
        """The leading dims of each head that are rotated (transformers: int(head_dim * partial_rotary_factor)).
        Proportional rotary (Gemma-4) rotates the whole head as pairs (i, i + d/2), the pairs past its
        partial_rotary_factor share at frequency 0 (rope_inv_freq): every dim is in the tables."""
        return head_dim if self.rope_type == "proportional" else int(head_dim * self.partial_rotary_factor)


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    routing: Routing
    router_bias: bool
    weights_in_fp32: bool  # Mixtral keeps routing weights fp32 when weighting expert outputs
    expert_kind: ExpertKind
    shared_intermediate_size: int  # 0 = no shared expert
    swiglu_limit: float | None = None
    swiglu_alpha: float | None = None
    shared_gated: bool = True  # the shared expert's output is scaled by a sigmoid gate (Qwen2-MoE); GLM: ungated
    router_fp32: bool = False  # router weight held in fp32 and logits computed in fp32 (transformers keeps it so)
    # routing "sigmoid_groups" only (see Routing): groups, the groups kept, the weights' scale, a correction bias
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    correction_bias: bool = False  # e_score_correction_bias [E] per MoE layer (fp32), added for the choice only
    # MoE layers whose experts a token-id table picks (DeepSeek-V4's hash-routed first layers: tid2eid [vocab,
    # top_k], no correction bias); the router's scores still weight them
    hash_layers: tuple[int, ...] = ()
    # routing "normed_softmax_topk" only: the router's input scale [H] and the per-expert scales [E] (Gemma-4)
    expert_scales: bool = False


@dataclass(frozen=True)
class AttentionOverride:
    """`layers` whose attention differs from ModelSpec.attention in shape and rotary (Gemma-4's global layers: wider
    heads, fewer of them, keys as values, proportional rotary); their KV group holds its own head shape."""

    layers: tuple[int, ...]
    attention: AttentionSpec
    rope: RopeSpec


@dataclass(frozen=True)
class SandwichSpec:
    """Gemma-4's decoder layer (models/layers/sandwich.py): each part normed before and after (the post-attention norm
    on the attention's output, pre/post feed-forward norms around the MLP), in MoE layers a dense MLP beside the
    experts, each output normed (post_feedforward_layernorm_1 / _2) before their sum; the router reads the residual,
    the experts its pre_feedforward_layernorm_2; the layer's output times its layer_scalar."""

    dense_beside_moe: bool = True


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    model_type: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    dense_intermediate_size: int
    moe_layers: tuple[bool, ...]  # per layer: True = sparse MoE block, False = dense MLP
    attention: AttentionSpec
    rope: RopeSpec
    moe: MoeSpec
    config_dtype: str | None
    norm_style: NormStyle = "cast_then_scale"
    # Layers the checkpoint holds past num_layers that are not served: multi-token-prediction (MTP) layers
    # (num_nextn_predict_layers), skipped at load and logged; their tensors count in no resident size.
    skipped_layers: int = 0
    linear_attention: LinearAttentionSpec | None = None  # hybrid models: which layers are linear attention
    mla: MlaSpec | None = None  # multi-head latent attention in every attention layer (DeepSeek-V3, Kimi-K2)
    mamba: MambaSpec | None = None  # Mamba-2 mixers (Nemotron-H)
    # Hybrids of one-part blocks (Nemotron-H: each layer is ONE of mixer / MLP): layers with no token mixer and
    # layers with no MLP. The missing part adds nothing to the residual stream and keeps no sequence memory.
    mixerless_layers: tuple[int, ...] = ()
    mlpless_layers: tuple[int, ...] = ()
    # dense and shared-expert MLPs (relu2: up -> relu^2 -> down; geglu: SwiGLU with tanh GELU, Gemma-4)
    mlp_kind: Literal["swiglu", "relu2", "geglu"] = "swiglu"
    hyper: HyperSpec | None = None  # hyper-connections in place of the residual and its norms (Qwen4-Exp)
    ngram: NgramSpec | None = None  # the hashed n-gram per-layer embedding (Qwen4-Exp)
    qsa: QsaSpec | None = None  # the sparse-attention indexer of every attention layer (Qwen4-Exp)
    compressed: CompressedAttentionSpec | None = None  # DeepSeek-V4's attention in every layer
    mhc: MhcSpec | None = None  # manifold-constrained hyper-connections (DeepSeek-V4)
    attention_override: AttentionOverride | None = None  # layers of another attention shape (Gemma-4's global)
    sandwich: SandwichSpec | None = None  # norms after each part too, a dense MLP beside the MoE (Gemma-4)
    embed_scale: float | None = None  # the embedding rows times this, cast to the compute dtype first (Gemma)
    logit_softcap: float | None = None  # logits = cap * tanh(logits / cap), in the compute dtype (Gemma)

    def attention_at(self, layer: int) -> AttentionSpec:
        """Layer `layer`'s attention: the override's in its layers, else `attention`."""
        o = self.attention_override
        return o.attention if o is not None and layer in o.layers else self.attention

    def rope_at(self, layer: int) -> RopeSpec:
        o = self.attention_override
        return o.rope if o is not None and layer in o.layers else self.rope

    @property
    def attention_layers(self) -> tuple[bool, ...]:
        """Per layer: True = softmax attention over a KV cache, False = linear attention or Mamba (recurrent
        state), or no token mixer at all (mixerless_layers)."""
        linear = set(self.linear_attention.layers if self.linear_attention else ())
        linear |= set(self.mamba.layers if self.mamba else ()) | set(self.mixerless_layers)
        return tuple(i not in linear for i in range(self.num_layers))

    @property
    def moe_layer_ids(self) -> list[int]:
        return [i for i, is_moe in enumerate(self.moe_layers) if is_moe]


# Bounds of the config.json integers that size memory, inclusive: generous (no released model comes near
# them) but finite, so a corrupt or mistyped file is refused before anything is allocated from it. A field
# read under an alias (num_local_experts for num_experts, ...) is bounded by the first name the reader asks for.
INT_BOUNDS: dict[str, tuple[int, int]] = {
    "num_hidden_layers": (1, 4096),
    "hidden_size": (1, 2**17),
    "intermediate_size": (1, 2**20),
    "moe_intermediate_size": (1, 2**20),
    "shared_expert_intermediate_size": (0, 2**20),  # 0 = no shared expert
    "num_experts": (1, 2**16),
    "num_local_experts": (1, 2**16),
    "num_experts_per_tok": (1, 2**16),
    "num_attention_heads": (1, 2**14),
    "num_key_value_heads": (1, 2**14),
    "head_dim": (2, 2**13),
    "vocab_size": (1, 2**24),
    "max_position_embeddings": (1, 2**24),
    "sliding_window": (1, 2**24),
    "decoder_sparse_step": (1, 4096),
    "n_routed_experts": (1, 2**16),
    "n_shared_experts": (0, 64),
    "n_group": (1, 2**16),
    "topk_group": (1, 2**16),
    "first_k_dense_replace": (0, 4096),
    "num_nextn_predict_layers": (0, 64),
    "mtp_num_hidden_layers": (0, 64),
    "num_mtp_modules": (0, 64),
    "full_attention_interval": (1, 4096),
    "linear_num_key_heads": (1, 2**14),
    "linear_num_value_heads": (1, 2**14),
    "linear_key_head_dim": (1, 2**13),
    "linear_value_head_dim": (1, 2**13),
    "linear_conv_kernel_dim": (1, 64),
    "q_lora_rank": (1, 2**16),
    "kv_lora_rank": (1, 2**16),
    "qk_nope_head_dim": (1, 2**13),
    "qk_rope_head_dim": (2, 2**13),
    "v_head_dim": (1, 2**13),
    "index_topk": (1, 2**24),
    "index_head_dim": (2, 2**13),
    "index_n_heads": (1, 2**14),
    "mamba_num_heads": (1, 2**14),
    "mamba_head_dim": (1, 2**13),
    "n_groups": (1, 2**14),
    "ssm_state_size": (1, 2**14),
    "conv_kernel": (2, 64),
    "moe_shared_expert_intermediate_size": (0, 2**20),
    "hc_count": (2, 64),
    "hc_lowrank": (1, 2**16),
    "ple_embed_dim": (1, 2**17),
    "ple_conv_kernel_size": (1, 64),
    "ngram_size": (2, 8),
    "heads_per_ngram": (1, 1024),
    "ngram_vocab_size_base": (2, 2**34),
    "make_ngram_vocab_size_divisible_by": (1, 2**20),
    "split_ngram_parts": (1, 2**16),
    "indexer_n_heads": (1, 2**14),
    "indexer_kv_heads": (1, 1),  # Qwen4-Exp's indexer has one key head
    "indexer_head_dim": (2, 2**13),
    "indexer_budget": (1, 2**24),
    "indexer_compress_ratio": (1, 2**16),
    "o_groups": (1, 2**14),
    "o_lora_rank": (1, 2**16),
    "hc_mult": (1, 64),
    "hc_sinkhorn_iters": (1, 1000),
    "num_hash_layers": (0, 4096),
    "global_head_dim": (2, 2**13),
    "num_global_key_value_heads": (1, 2**14),
    "top_k_experts": (1, 2**16),
}
OTHER_INT_BOUNDS = (0, 2**31 - 1)
# Floats: (lowest, highest), both exclusive. NaN and infinity are refused for every float.
FLOAT_BOUNDS: dict[str, tuple[float, float]] = {
    "rms_norm_eps": (0.0, 1.0),
    "rope_theta": (1.0, math.inf),
    "factor": (0.0, math.inf),  # rope scaling
    "beta_fast": (0.0, math.inf),
    "beta_slow": (0.0, math.inf),
    "attention_factor": (0.0, math.inf),
    "swiglu_limit": (0.0, math.inf),
    "clip_qkv": (0.0, math.inf),
    "original_max_position_embeddings": (0.0, 2.0**24),  # yarn; some configs write it as a float
    "partial_rotary_factor": (0.0, 1.0 + 1e-9),  # (0, 1]
    "routed_scaling_factor": (0.0, math.inf),
    "mscale": (-1e-300, math.inf),  # yarn (DeepSeek): >= 0, 0 = not used (transformers' test is truthiness)
    "mscale_all_dim": (-1e-300, math.inf),
    "layer_norm_epsilon": (0.0, 1.0),
    "time_step_min": (-1e-300, math.inf),  # >= 0
    "hc_eps": (0.0, 1.0),
    "final_logit_softcapping": (0.0, math.inf),
}
ROPE_REQUIRED = {"default": (), "linear": (), "yarn": ("factor", "original_max_position_embeddings"),
                 "proportional": ()}


class ConfigReader:
    """Typed access to config.json with errors that name the key (invalid config.json is a user error).
    Integers and floats are checked against INT_BOUNDS / FLOAT_BOUNDS as they are read."""

    def __init__(self, config: dict[str, Any], where: str) -> None:
        self.config = config
        self.where = where

    def get(self, *keys: str, default: Any = ...) -> Any:
        """The first of `keys` present (configs of one family spell some fields two ways)."""
        for key in keys:
            if key in self.config and self.config[key] is not None:
                return self.config[key]
        if default is ...:
            raise CheckpointError(f"{self.where}: missing required key '{keys[0]}'")
        return default

    def int(self, *keys: str, default: Any = ...) -> int:
        return check_int(self.get(*keys, default=default), keys[0], self.where)

    def optional_int(self, *keys: str) -> builtins.int | None:
        value = self.get(*keys, default=None)
        return None if value is None else check_int(value, keys[0], self.where)

    def float(self, *keys: str, default: Any = ...) -> float:
        return check_float(self.get(*keys, default=default), keys[0], self.where)

    def optional_float(self, *keys: str) -> builtins.float | None:
        value = self.get(*keys, default=None)
        return None if value is None else check_float(value, keys[0], self.where)

    def optional_str(self, *keys: str) -> str | None:
        value = self.get(*keys, default=None)
        if value is not None and not isinstance(value, str):
            raise CheckpointError(f"{self.where}: '{keys[0]}' must be a string, got {_short(value)}")
        return value

    def bool(self, *keys: str, default: Any = ...) -> bool:
        value = self.get(*keys, default=default)
        if not isinstance(value, bool):
            raise CheckpointError(f"{self.where}: '{keys[0]}' must be true or false, got {_short(value)}")
        return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_int(value: Any, key: str, where: str) -> int:
    """`value` as the integer field `key` (bools, floats and strings refused), within INT_BOUNDS."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise CheckpointError(f"{where}: '{key}' must be an integer, got {_short(value)}")
    lo, hi = INT_BOUNDS.get(key, OTHER_INT_BOUNDS)
    if not lo <= value <= hi:
        raise CheckpointError(f"{where}: '{key}' = {_short(value)} is out of range [{lo}, {hi}]")
    return value


def check_float(value: Any, key: str, where: str) -> float:
    """`value` as the number field `key`: finite (NaN and Infinity refused), within FLOAT_BOUNDS."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CheckpointError(f"{where}: '{key}' must be a number, got {_short(value)}")
    x = float(value)
    lo, hi = FLOAT_BOUNDS.get(key, (-math.inf, math.inf))
    if not (math.isfinite(x) and lo < x < hi):
        bounds = "" if lo == -math.inf else f" > {lo:g}" if hi == math.inf else f" in ({lo:g}, {hi:g})"
        raise CheckpointError(f"{where}: '{key}' = {_short(value)}; it must be a finite number{bounds}")
    return x


def read_rope(c: ConfigReader) -> RopeSpec:
    """RoPE from transformers 5 `rope_parameters` or the legacy `rope_theta` + `rope_scaling`; every number
    in them checked (finite, in bounds), and the parameters the rope type needs present."""
    params = c.get("rope_parameters", default={}) or {}
    legacy = c.get("rope_scaling", default=None)
    if not isinstance(params, dict) or not isinstance(legacy, dict | None):
        raise CheckpointError(f"{c.where}: 'rope_parameters' and 'rope_scaling' must be objects")
    params = {**(legacy or {}), **params}
    theta = check_float(params.pop("rope_theta", c.get("rope_theta", default=10000.0)), "rope_theta", c.where)
    partial = check_float(params.pop("partial_rotary_factor", c.get("partial_rotary_factor", default=1.0)),
                          "partial_rotary_factor", c.where)
    rope_type = str(params.pop("rope_type", params.pop("type", "default")))
    if rope_type not in ROPE_REQUIRED:
        raise CheckpointError(f"{c.where}: rope type '{rope_type}' is not supported ({', '.join(ROPE_REQUIRED)})")
    for key in ROPE_REQUIRED[rope_type]:
        if params.get(key) is None:
            raise CheckpointError(f"{c.where}: rope type '{rope_type}' needs '{key}'")
    for key, value in params.items():
        if key in INT_BOUNDS:
            check_int(value, key, c.where)
        elif key in FLOAT_BOUNDS or isinstance(value, float):
            check_float(value, key, c.where)
    return RopeSpec(theta=theta, rope_type=rope_type, params=tuple(sorted(params.items())),
                    partial_rotary_factor=partial)


def moe_layer_pattern(c: ConfigReader, num_layers: int, num_experts: int) -> tuple[bool, ...]:
    """Qwen-style rule: layer i is sparse unless listed in mlp_only_layers or off the decoder_sparse_step grid."""
    step = c.int("decoder_sparse_step", default=1)
    dense = c.get("mlp_only_layers", default=[]) or []
    if not isinstance(dense, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in dense):
        raise CheckpointError(f"{c.where}: 'mlp_only_layers' must be a list of layer numbers")
    return tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers))


def base_attention(c: ConfigReader, num_layers: int, **switches: Any) -> AttentionSpec:
    hidden = c.int("hidden_size")
    heads = c.int("num_attention_heads")
    head_dim = c.int("head_dim", default=hidden // heads)
    use_window = switches.pop("use_window", False)
    window = c.optional_int("sliding_window") if use_window else None
    windows: tuple[int | None, ...] = tuple(window for _ in range(num_layers))
    return AttentionSpec(
        num_heads=heads,
        num_kv_heads=c.int("num_key_value_heads", default=heads),
        head_dim=head_dim,
        sliding_window=windows,
        **{"qkv_bias": False, "o_bias": False, "qk_norm": "none", "clip_qkv": None, "sinks": False, **switches},
    )


def check_spec(spec: ModelSpec, where: str) -> None:
    """The relations between config.json fields that each field's own bounds (INT_BOUNDS) cannot say; raises a
    CheckpointError naming `where` (config.json) and the fields."""
    m = spec.moe
    problems = []
    if m.top_k > m.num_experts:
        problems.append(f"num_experts_per_tok={m.top_k} is more than the {m.num_experts} experts per layer")
    o = spec.attention_override  # its layers' shape and rotary are checked alike (Gemma-4's global layers)
    for a, rope, which in ((spec.attention, spec.rope, ""), *(((o.attention, o.rope, " (full-attention layers)"),)
                                                               if o is not None else ())):
        if a.num_heads % a.num_kv_heads:
            problems.append(f"num_attention_heads={a.num_heads} is not a multiple of num_key_value_heads="
                            f"{a.num_kv_heads}{which}")
        if a.head_dim % 2:
            problems.append(f"head_dim={a.head_dim}{which} is odd (rotary embeddings rotate pairs)")
        elif rope.rotary_dim(a.head_dim) % 2 or rope.rotary_dim(a.head_dim) == 0:
            problems.append(f"partial_rotary_factor={rope.partial_rotary_factor:g} of head_dim={a.head_dim}{which} "
                            f"rotates {rope.rotary_dim(a.head_dim)} dims (rotary embeddings rotate pairs)")
    if m.num_experts % m.n_group or not 1 <= m.topk_group <= m.n_group:
        problems.append(f"n_group={m.n_group} must divide the {m.num_experts} experts and topk_group="
                        f"{m.topk_group} lie in [1, n_group]")
    elif m.routing == "sigmoid_groups" and m.top_k > m.topk_group * (m.num_experts // m.n_group):
        problems.append(f"num_experts_per_tok={m.top_k} is more than the experts of topk_group={m.topk_group} groups")
    elif m.routing == "sigmoid_groups" and m.n_group > 1 and m.num_experts // m.n_group < 2:
        problems.append(f"n_group={m.n_group} leaves groups of one expert (a group's score sums its top 2)")
    if not any(spec.moe_layers):
        problems.append("no layer is a MoE layer (mlp_only_layers / decoder_sparse_step leave none)")
    if problems:
        raise CheckpointError(f"{where}: {'; '.join(problems)}")
