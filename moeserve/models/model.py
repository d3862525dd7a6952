"""MoeModel: embeddings, decoder layers and head built from a checkpoint; experts live in an ExpertStore.

Every way of computing is chosen once, in `build_model`, from `ModelOptions`, and named in `MoeModel.choices` (the
start-up log prints them): the dense Linears' layout (layers/linear.py), the routing and expert kernel of the MoE layers
(experts/moe.py, experts/kernels.py), the layer pass and the decode step (passes.py, decode_stack.py). Nothing changes
after construction. Expert weights are not owned by the model: the store loads them (all of them in the resident
case, a budgeted cache otherwise).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from moeserve.checkpoint.folder import Checkpoint
from moeserve.errors import MoeserveError
from moeserve.experts.owned import OwnedSource
from moeserve.experts.placement import Costs, PlacementStats
from moeserve.experts.store import ExpertStore, StoreOptions
from moeserve.formats import QuantScheme
from moeserve.models.decode_stack import choose_decode_step
from moeserve.models.experts.hybrid import place_experts
from moeserve.models.experts.kernels import ExpertKernel, choose_expert_kernel
from moeserve.models.experts.moe import ForcedRouting, MoEBlock, choose_routing
from moeserve.models.experts.plans import ExpertPlan
from moeserve.models.experts.remote import EpShare, ExpertParallel
from moeserve.models.hyper_build import gated_residual, hyper_layer
from moeserve.models.layer_weights import norm_weight as _norm
from moeserve.models.layer_weights import qkv_linear as _qkv_linear
from moeserve.models.layers.base import (
    MLP,
    RMS_NORMS,
    DecoderLayer,
    DenseMLP,
    ForwardBatch,
    Rotary,
    TokenMixer,
    scales_in_fp32,
)
from moeserve.models.layers.block_parts import NoMixer, NoMLP, NoRotary, Relu2MLP
from moeserve.models.layers.hyper import GatedResidual
from moeserve.models.layers.hyper_layer import HyperLayers
from moeserve.models.layers.linear import Linear
from moeserve.models.layers.mhc_layer import ClampedMLP
from moeserve.models.layers.sandwich import GeGLUMLP
from moeserve.models.loader import WeightLoader
from moeserve.models.mhc_build import compressed_ropes, mhc_layer, mhc_pass
from moeserve.models.mixers.attention import Attention
from moeserve.models.mixers.compressed_mixer import CompressedAttention, Ropes, build_compressed_attention
from moeserve.models.mixers.gated_delta import GatedDeltaNet, build_gated_delta
from moeserve.models.mixers.mamba2 import Mamba2Mixer, build_mamba
from moeserve.models.mixers.mla import MlaAttention, build_mla
from moeserve.models.mixers.qsa_attention import QsaAttention, build_qsa_attention
from moeserve.models.ngram_table import NgramTable
from moeserve.models.numerics import Numerics
from moeserve.models.passes import CppLayers, LayerPass, TorchLayers
from moeserve.models.quantized import activation_scales
from moeserve.models.registry import Architecture, WeightNames
from moeserve.models.sandwich_build import sandwich_expert_norm, sandwich_layer, scaled_router
from moeserve.models.spec import ModelSpec
from moeserve.models.validate import is_skipped
from moeserve.state.kv_cache import PagedKVCache


@dataclass(frozen=True)
class ModelOptions:
    """How the model computes (EngineSettings: kernels, quantization, batch_invariant, decode_step)."""

    numerics: Numerics = field(default_factory=Numerics)  # C++ ops or torch, batch invariance, row block
    numerics_reason: str = ""  # why these numerics (choose_numerics), for the start-up log
    dense_int8: bool = False  # quantization="int8" / "int4": dense Linears as int8 (with the C++ ops; see build_model)
    decode_step: str = "auto"  # auto, fused, per_op (decode_stack.choose_decode_step)
    placement: str = "auto"  # where missed experts are computed on a GPU machine (models/experts/hybrid.py)
    placement_costs: Costs | None = None  # what the hybrid placement weighs (measured at start-up), or None
    ep: EpShare | None = None  # expert parallelism: this rank's store holds its experts, the rest are remote
    ngram_capacity: int | None = None  # n-gram table row blocks held in memory (models/ngram_table.py); None: all


class MoeModel:
    def __init__(self, spec: ModelSpec, embed: torch.Tensor, layers: list[DecoderLayer], final_norm: torch.Tensor,
                 head: Linear | None, store: ExpertStore, resident_bytes: int, options: ModelOptions,
                 final_mixer: GatedResidual | None = None, layer_pass: LayerPass | None = None) -> None:
        """`head`: the LM head, or None when tied to the embedding (lookups need the table as it is);
        `final_mixer`: with hyper-connections (ModelSpec.hyper), the gated residual before the head (no final norm)."""
        self.spec, self.embed, self.layers = spec, embed, layers
        self.final_norm, self.store, self.options = final_norm, store, options
        self._head = head
        self.resident_bytes = resident_bytes  # non-expert weights
        self.dequantized_linears: list[str] = []  # quantized dense Linears that were dequantized at load
        self.moe_blocks = [layer.mlp for layer in layers if isinstance(layer.mlp, MoEBlock)]
        self.norm = RMS_NORMS[spec.norm_style][0]
        eps = spec.rms_norm_eps
        fused_norms = options.numerics.cpp and all(layer.fuses_norms for layer in layers)
        self.layer_pass: LayerPass = (layer_pass if layer_pass is not None else
                                      HyperLayers(layers, final_mixer) if final_mixer is not None else
                                      CppLayers(layers, final_norm, eps, scales_in_fp32(spec.norm_style))
                                      if fused_norms else TorchLayers(layers, final_norm, self.norm, eps))
        # Gemma: the rows times sqrt(hidden) cast to the compute dtype first, as transformers' scaled embedding
        self._embed_scale = None if spec.embed_scale is None else torch.tensor(spec.embed_scale).to(embed.dtype)
        self.decode_step, decode_reason = choose_decode_step(self, options.decode_step)
        self._traced = False  # a trace hook is set: the layer pass runs (the hook sees each layer's routing)
        self._forced = False  # routing forced (force_routing, benchmark only): the layer pass runs
        self.closed = False  # close(): the weights are gone
        self.ngram_table: NgramTable | None = None  # the PLE layers' n-gram tables (ModelSpec.ngram), set by build_model
        # (name, one-line reason) of every choice made here, for the start-up log and the engine's record
        self.choices: list[tuple[str, str]] = [("decode step", decode_reason)]

    def close(self) -> None:
        """Stop the store's threads and drop every weight now: the layers, the passes (the fused step's C++ stack
        holds the weights and the KV cache), the embedding, the head and the store's pool are freed when this
        returns, not at Python's next cycle collection. Idempotent; `forward` refuses to run afterwards."""
        if self.closed:
            return
        self.closed = True
        self.store.close()
        if self.ngram_table is not None:
            self.ngram_table.close()
        if self.moe_blocks:
            self.moe_blocks[0].experts.close()  # one kernel object serves every MoE layer
        self.layers, self.moe_blocks = [], []
        self.layer_pass = self.decode_step = None  # type: ignore[assignment]
        self.embed = self.final_norm = torch.empty(0)
        self._head = None

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        """Logits (fp32) [num_seqs, vocab] of each sequence's last new token."""
        if self.closed:
            raise MoeserveError("the model was closed (LLMEngine.close()): open a new engine to run it")
        h = self.embed[batch.token_ids]  # [N, H]
        if self._embed_scale is not None:
            h = h * self._embed_scale
        step = self.decode_step
        fused = not self._traced and not self._forced and step is not None and step.accepts(batch)
        run = step if step is not None and fused else self.layer_pass
        last = run.run(h, batch, kv)
        if self._head is not None:
            return self._softcap(self._head(last)).float()
        tied = functools.partial(torch.nn.functional.linear, weight=self.embed)  # tied: the head is the embedding
        return self._softcap(self.options.numerics.rows(tied, last)).float()

    def _softcap(self, logits: torch.Tensor) -> torch.Tensor:
        """cap * tanh(logits / cap) in the compute dtype (transformers' final_logit_softcapping), row by row: a
        vectorised tanh's tail must not move with the batch."""
        cap = self.spec.logit_softcap
        if cap is None:
            return logits
        return torch.cat([torch.tanh(row / cap) * cap for row in logits.split(1)])

    @property
    def lm_head(self) -> torch.Tensor:
        """The LM head weight [vocab, H] as a plain tensor (a copy when packed)."""
        return self._head.weight if self._head is not None else self.embed

    def set_trace_hook(self, hook: Callable[[int, torch.Tensor, list[int] | None], None] | None) -> None:
        """Call `hook(layer, topk_ids [N, k], predicted next-layer experts or None)` in every MoE layer."""
        self._traced = hook is not None
        for block in self.moe_blocks:
            block.trace_hook = hook

    def force_routing(self, forced: Callable[[int, int], torch.Tensor] | None) -> None:
        """BENCHMARK ONLY (moeserve bench --route-trace): MoE block i routes its N tokens to `forced(i, N)`
        ([N, k] expert ids) instead of its router's top-k (moe.ForcedRouting), through the per-op layer pass (the
        fused decode step routes inside C++). None restores the routers' own choice."""
        self._forced = forced is not None
        for i, block in enumerate(self.moe_blocks):
            inner = block.routing.inner if isinstance(block.routing, ForcedRouting) else block.routing
            block.routing = inner if forced is None else ForcedRouting(inner, functools.partial(forced, i))


def placement_stats(model: MoeModel) -> tuple[PlacementStats, Costs] | None:
    """The hybrid placement's counters and costs (/metrics), or None when every expert is computed where held."""
    return model.moe_blocks[0].experts.placement_stats() if model.moe_blocks else None


def link_prefetch(blocks: list[MoEBlock]) -> None:
    """Give each MoE block the router of the next MoE block, so it can predict that layer's experts."""
    for block, nxt in zip(blocks, blocks[1:]):
        block.predict_next = nxt


def effective_options(options: ModelOptions) -> ModelOptions:
    """The int8 dense GEMV is a C++ op: without the C++ ops (`numerics.cpp`) the dense Linears stay as they are."""
    return replace(options, dense_int8=options.dense_int8 and options.numerics.cpp)


def build_model(
    ckpt: Checkpoint,
    arch: Architecture,
    spec: ModelSpec,
    dtype: torch.dtype,
    device: torch.device,
    max_len: int,
    plan: ExpertPlan,
    expert_capacity: int,
    cache_policy: str,
    progress: Callable[[int], None] | None = None,
    store_options: StoreOptions | None = None,
    options: ModelOptions | None = None,
) -> MoeModel:
    """Stream the checkpoint into a MoeModel whose store holds `expert_capacity` experts in the fast tier.
    `options.dense_int8` (quantization="int8" or "int4"): with the C++ ops, the dense Linears that every token reads in full
    (q/k/v, o, dense and shared-expert MLPs, LM head) become per-row int8 (see Linear); routers and the shared-
    expert gate stay in the compute dtype (tiny, and they pick the experts: a flipped choice costs more than their
    bytes save), and so does the embedding (a token reads one row of it)."""
    asked = options or ModelOptions()
    opts = effective_options(asked)
    numerics = opts.numerics
    choices: list[tuple[str, str]] = []
    load = WeightLoader(ckpt, dtype, device, progress, numerics, opts.dense_int8)
    names = arch.names
    source, num_experts = plan.source(ckpt), spec.moe.num_experts
    if opts.ep is not None:  # this rank's experts only, under local ids
        source, num_experts = OwnedSource(source, opts.ep.mine), len(opts.ep.mine)
    store = ExpertStore(source, spec.moe_layer_ids, num_experts, expert_capacity, device, cache_policy, progress,
                        store_options or StoreOptions(policy=cache_policy))
    kernel = choose_expert_kernel(plan.math, numerics, dtype, device, top_k=spec.moe.top_k)
    if opts.ep is not None:
        kernel, placement = (ExpertParallel(kernel, opts.ep.link, opts.ep.owners),
                             f"expert parallelism: {len(opts.ep.mine)} of {spec.moe.num_experts} experts per layer "
                             "here, the others on their ranks")
    else:
        kernel, placement = place_experts(kernel, plan.math, dtype, store, opts.placement, opts.placement_costs, spec)
    choices += [("expert kernel", kernel.describe()), ("placement", placement)]
    rotary = (NoRotary(spec.attention.head_dim, max_len, dtype, device) if spec.rope.rope_type == "none"
              else Rotary(spec.rope, spec.attention.head_dim, max_len, dtype, device))
    o = spec.attention_override  # its layers' own tables (another head_dim and rotary)
    other = Rotary(o.rope, o.attention.head_dim, max_len, dtype, device) if o is not None else rotary
    embed = load.tensor(arch.names.embed, (spec.vocab_size, spec.hidden_size))
    table = (NgramTable.build(ckpt, arch, spec, dtype, device, opts.ngram_capacity,
                              replace(store_options or StoreOptions(policy=cache_policy), prefetch=False,
                                      host_capacity=0, cache_mode="shared"))
             if spec.ngram is not None else None)
    ropes = compressed_ropes(spec, max_len, device) if spec.compressed is not None else None
    layers = [_build_layer(load, arch, spec, L, other if o is not None and L in o.layers else rotary, store, kernel,
                           opts, table, ropes) for L in range(spec.num_layers)]
    choices += _layer_choices(ckpt, arch, spec, layers, load)
    final_norm = _norm(load, names.final_norm, spec) if spec.hyper is None and spec.mhc is None else torch.empty(0)
    streams = mhc_pass(load, arch, spec, layers, opts) if spec.mhc is not None else None
    final_mixer = gated_residual(load, spec, names.hc_final, False, opts) if spec.hyper is not None else None
    head = _lm_head(load, ckpt, names, spec, embed, opts.dense_int8)
    model = MoeModel(spec, embed, layers, final_norm, head, store, load.resident_bytes, opts, final_mixer, streams)
    model.ngram_table = table
    if store.prefetcher is not None:
        link_prefetch(model.moe_blocks)
    model.dequantized_linears = load.dequantized_linears
    model.choices = choices + model.choices + [("batch invariance", opts.numerics_reason or numerics.id)]
    int8 = _int8_summary(asked, opts, load.int8_linears, dtype)
    if int8:
        model.choices.append(("dense layers", int8))
    return model


def _layer_choices(ckpt: Checkpoint, arch: Architecture, spec: ModelSpec, layers: list[DecoderLayer],
                   load: WeightLoader) -> list[tuple[str, str]]:
    """The start-up lines that describe the built layers: routing, skipped and unserved tensors, recurrent mixers."""
    choices: list[tuple[str, str]] = []
    moe_blocks = [layer.mlp for layer in layers if isinstance(layer.mlp, MoEBlock)]
    if moe_blocks:  # a config may make every layer dense (mlp_only_layers)
        choices.append(("routing", moe_blocks[0].routing.describe()))
    if spec.skipped_layers:
        skipped = [ref.nbytes for name, ref in ckpt.tensors.items() if is_skipped(arch, spec, name)]
        choices.append(("skipped layers", f"{spec.skipped_layers} announced (num_nextn_predict_layers, MiniMax-M2's "
                        f"num_mtp_modules): the multi-token-prediction layers past the {spec.num_layers} served are not loaded ({len(skipped)} tensors, "
                        f"{sum(skipped) / 2**20:.1f} MiB in the checkpoint); greedy decoding does not use them"))
    choices += _unserved(ckpt, arch) + _activation_scales(ckpt, load.scheme)
    for kind, what in ((Attention, "attention"), (MlaAttention, "latent attention"), (QsaAttention, "sparse attention"),
                       (CompressedAttention, "compressed attention")):
        found = [layer.attn for layer in layers if isinstance(layer.attn, kind)]
        if found:
            choices.append((what, f"{len(found)} layers; {found[0].describe()}"))  # type: ignore[attr-defined]
    linear = [layer.attn for layer in layers if isinstance(layer.attn, GatedDeltaNet)]
    if linear:
        choices.append(("linear attention", f"{len(linear)} layers; {linear[0].describe()}"))
    mambas = [layer.attn for layer in layers if isinstance(layer.attn, Mamba2Mixer)]
    if mambas:
        choices.append(("mamba", f"{len(mambas)} layers; {mambas[0].describe()}"))
    return choices


def _lm_head(load: WeightLoader, ckpt: Checkpoint, names: WeightNames, spec: ModelSpec, embed: torch.Tensor,
             dense_int8: bool) -> Linear | None:
    """The LM head, or None when tied to the embedding (MoeModel.forward then multiplies by the table itself)."""
    if spec.tie_word_embeddings and not ckpt.has(names.lm_head + ".weight"):
        if not dense_int8:
            return None
        load.resident_bytes += embed.numel() * embed.element_size()  # an int8 copy of the tied table for the head
        return load.make_linear(embed, None)  # lookups keep the table itself
    return load.make_linear(load.linear_weight(names.lm_head, spec.vocab_size, spec.hidden_size), None)


def _unserved(ckpt: Checkpoint, arch: Architecture) -> list[tuple[str, str]]:
    """A start-up line per group of checkpoint tensors the architecture does not serve (Architecture.unserved)."""
    lines = []
    for prefix, why in arch.unserved:
        sizes = [ref.nbytes for name, ref in ckpt.tensors.items() if name.startswith(prefix)]
        if sizes:
            lines.append((f"not loaded: {prefix}*", f"{why} ({len(sizes)} tensors, {sum(sizes) / 2**20:.1f} MiB in "
                          "the checkpoint, never read)"))
    return lines


def _activation_scales(ckpt: Checkpoint, scheme: QuantScheme) -> list[tuple[str, str]]:
    """A start-up line for the activation scales a W4A4 checkpoint stores beside its weights (never read)."""
    names = activation_scales(ckpt, scheme)
    if not names:
        return []
    roles = ", ".join(sorted({name.rpartition(".")[2] for name in names}))
    return [("not loaded: activation scales", f"{len(names)} tensors ({roles}) for quantizing the activations to "
             f"{scheme.weight_format.name}: activations are computed in the compute dtype, the weights dequantized")]


def _int8_summary(asked: ModelOptions, opts: ModelOptions, int8_linears: int, dtype: torch.dtype) -> str:
    """quantization="int8" / "int4": what build_model quantized in the dense part, and why ("" when not asked)."""
    if opts.dense_int8 and int8_linears == 0:
        return (f"kept in {str(dtype).removeprefix('torch.')}: the int8 dense GEMV takes bf16 activations (and "
                "K % 32 == 0), so only the experts are quantized")
    if opts.dense_int8:
        return (f"{int8_linears} Linears quantized to int8 with per-row float32 scales (q/k/v, o_proj, dense and "
                "shared-expert MLPs, LM head); kept in the compute dtype: routers and shared-expert gates (tiny, "
                "and they choose the experts), embedding (one row read per token), norms")
    if asked.dense_int8:
        return ("kept in the compute dtype: the int8 dense GEMV needs the C++ kernels (kernels=torch or "
                "unavailable), so only the experts are quantized")
    return ""


def _build_layer(load: WeightLoader, arch: Architecture, spec: ModelSpec, L: int, rotary: Rotary,  # noqa: PLR0913
                 store: ExpertStore, kernel: ExpertKernel, opts: ModelOptions,
                 table: NgramTable | None = None, ropes: Ropes | None = None) -> DecoderLayer:
    """Read layer L's resident weights (attention or linear attention, norms, router, dense or shared MLP)."""
    names, h = arch.names, spec.hidden_size

    def n(template: str) -> str:
        return template.format(L=L)

    attn = _token_mixer(load, arch, spec, L, rotary, opts, ropes)
    mlp: MLP
    if L in spec.mlpless_layers:
        mlp = NoMLP()
    elif spec.moe_layers[L]:
        m = spec.moe
        shared = shared_gate = None
        if m.shared_intermediate_size:
            shared = _dense_mlp(load, spec, (names.shared_gate, names.shared_up, names.shared_down), L,
                                m.shared_intermediate_size, opts)
            if m.shared_gated:
                shared_gate = load.linear(n(names.shared_expert_gate), 1, h, quantize=False)
        if m.router_fp32:  # kept in fp32 as transformers keeps it: the logits are computed in fp32
            router = load.make_linear(load.tensor(n(names.router) + ".weight", (m.num_experts, h), torch.float32),
                                      None, quantize=False)
        else:
            router = load.linear(n(names.router), m.num_experts, h, m.router_bias, quantize=False)
        hashed = L in m.hash_layers  # DeepSeek-V4: experts by token id, no correction bias
        bias = (load.tensor(n(names.router_correction_bias), (m.num_experts,), torch.float32)
                if m.correction_bias and not hashed else None)
        experts_of = load.tensor(n(names.router_hash), (spec.vocab_size, m.top_k), torch.int64) if hashed else None
        routing = choose_routing(m, opts.numerics, bias, experts_of, scaled_router(load, arch, spec, L))
        expert_norm = sandwich_expert_norm(load, arch, spec, L)
        mlp = MoEBlock(m, L, router, store, kernel, routing, shared, shared_gate, opts.numerics, expert_norm)
    else:
        mlp = _dense_mlp(load, spec, (names.dense_gate, names.dense_up, names.dense_down), L,
                         spec.dense_intermediate_size, opts)
    if spec.hyper is not None:
        return hyper_layer(load, arch, spec, L, attn, mlp, opts, table)
    if spec.mhc is not None:
        return mhc_layer(load, arch, spec, L, attn, mlp, opts)
    if spec.sandwich is not None:
        dense = (_dense_mlp(load, spec, (names.dense_gate, names.dense_up, names.dense_down), L,
                            spec.dense_intermediate_size, opts) if spec.moe_layers[L] else None)
        return sandwich_layer(load, arch, spec, L, attn, mlp, dense)
    norm = RMS_NORMS[spec.norm_style][0]
    # a part the layer does not have (one-part blocks: Nemotron-H) adds zeros whatever its norm: ones, unread
    input_norm = _norm(load, n(names.input_norm), spec) if L not in spec.mixerless_layers else None
    post_norm = _norm(load, n(names.post_norm), spec) if L not in spec.mlpless_layers else None
    ones = torch.ones(h, dtype=RMS_NORMS[spec.norm_style][1] or load.dtype, device=load.device)
    return DecoderLayer(attn, mlp, ones if input_norm is None else input_norm,
                        ones if post_norm is None else post_norm, spec.rms_norm_eps, norm)


def _dense_mlp(load: WeightLoader, spec: ModelSpec, names: tuple[str, str, str], L: int, width: int,
               opts: ModelOptions) -> DenseMLP:
    """Layer L's dense (or shared-expert) MLP of `width`: SwiGLU from (gate, up, down), or relu2 from (up, down)."""
    gate, up, down = (t.format(L=L) for t in names)
    h = spec.hidden_size
    if spec.mlp_kind == "relu2":
        return Relu2MLP(load.linear(up, width, h), load.linear(down, h, width), opts.numerics)
    if spec.moe.expert_kind == "swiglu_clamp" and spec.moe.swiglu_limit is not None:  # DeepSeek-V4's shared expert
        return ClampedMLP(load.linear(gate, width, h), load.linear(up, width, h), load.linear(down, h, width),
                          spec.moe.swiglu_limit, opts.numerics)
    return (GeGLUMLP if spec.mlp_kind == "geglu" else DenseMLP)(load.linear(gate, width, h), load.linear(up, width, h), load.linear(down, h, width),
                    opts.numerics)


def _token_mixer(load: WeightLoader, arch: Architecture, spec: ModelSpec, L: int, rotary: Rotary,
                 opts: ModelOptions, ropes: Ropes | None = None) -> TokenMixer:
    """Layer L's token mixer: linear attention (spec.linear_attention), latent attention (spec.mla) or softmax
    attention with per-head keys and values."""
    if L in spec.mixerless_layers:
        return NoMixer()
    if spec.mamba is not None and L in spec.mamba.layers:
        return build_mamba(load, arch, spec, L, opts.numerics)
    if not spec.attention_layers[L]:
        return build_gated_delta(load, arch, spec, L, opts.numerics)
    if spec.compressed is not None and ropes is not None:
        return build_compressed_attention(load, arch, spec, L, ropes, opts.numerics)
    if spec.mla is not None:
        return build_mla(load, arch, spec, L, rotary, opts.numerics)
    if spec.qsa is not None:
        return build_qsa_attention(load, arch, spec, L, rotary, opts.numerics)
    return _build_attention(load, arch, spec, L, rotary, opts)


def _build_attention(load: WeightLoader, arch: Architecture, spec: ModelSpec, L: int, rotary: Rotary,
                     opts: ModelOptions) -> TokenMixer:
    """Layer L's softmax attention: q/k/v (and an output gate) stacked into one Linear, norms, sinks."""
    names, a, h = arch.names, spec.attention_at(L), spec.hidden_size

    def n(template: str) -> str:
        return template.format(L=L)

    q_norm = k_norm = None
    if a.qk_norm == "per_head":
        q_norm, k_norm = _norm(load, n(names.q_norm), spec, (a.head_dim,)), _norm(load, n(names.k_norm), spec,
                                                                                  (a.head_dim,))
    elif a.qk_norm == "full":
        q_norm = load.tensor(n(names.q_norm), (a.num_heads * a.head_dim,))
        k_norm = load.tensor(n(names.k_norm), (a.num_kv_heads * a.head_dim,))
    return Attention(
        a, L, qkv=_qkv_linear(load, names, a, L, h),
        o=load.linear(n(names.o_proj), h, a.num_heads * a.head_dim, a.o_bias),
        q_norm=q_norm, k_norm=k_norm,
        sinks=load.tensor(n(names.sinks), (a.num_heads,)) if a.sinks else None,
        rotary=rotary, eps=spec.rms_norm_eps, numerics=opts.numerics,
        qk_norm=RMS_NORMS[spec.norm_style][0] if a.qk_norm == "per_head" else RMS_NORMS["cast_then_scale"][0],
        v_norm=(torch.ones(a.head_dim, dtype=RMS_NORMS[spec.norm_style][1] or load.dtype, device=load.device)
                if a.v_norm else None),
    )
