"""MoeModel: embeddings, decoder layers and head built from a checkpoint; experts live in an ExpertStore.

Loading streams one tensor at a time straight into its final buffer (a dtype conversion costs one tensor of
transient memory, never more). Expert weights are not owned by the model: the store loads them (all of them in
the resident case, a budgeted cache otherwise).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from moeserve.checkpoint.finite import check_tensor
from moeserve.checkpoint.folder import Checkpoint
from moeserve.state.kv_cache import KVCache
from moeserve.errors import ConfigError
from moeserve.experts.store import ExpertStore, StoreOptions
from moeserve.experts.unit import ExpertSource, FieldSources, UnitLayout
from moeserve.models.decode_stack import unit_fields
from moeserve.models.layers import (
    FUSED_MAX_TOKENS,
    RMS_NORMS,
    Attention,
    DecoderLayer,
    DenseMLP,
    ExpertKernel,
    ForwardBatch,
    Linear,
    MoEBlock,
    Rotary,
    choose_row_block,
    in_row_blocks,
    swiglu_expert,
)
from moeserve.models.quantized import checkpoint_scheme, dequantize_at_load, is_stored_dense, linear_format
from moeserve.models.registry import Architecture
from moeserve.models.spec import ModelSpec


class WeightLoader:
    """Reads named tensors from the checkpoint into the compute dtype on the compute device."""

    def __init__(self, ckpt: Checkpoint, dtype: torch.dtype, device: torch.device,
                 progress: Callable[[int], None] | None = None, cpp: bool = False, int8: bool = False) -> None:
        self.ckpt, self.dtype, self.device, self.progress = ckpt, dtype, device, progress
        self.cpp = cpp  # dense Linears in the C++ GEMV's layout where it applies (see Linear)
        self.int8 = int8  # quantization="int8": dense Linears (but routers, gates) as int8 codes (see Linear)
        self.int8_linears = 0  # how many Linears were quantized to int8 at load
        self.resident_bytes = 0
        self.scheme = checkpoint_scheme(ckpt)
        self.dequantized_linears: list[str] = []  # quantized dense Linears, dequantized at load

    def tensor(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        ref = self.ckpt.ref(name, shape)
        dtype = dtype or self.dtype
        if ref.dtype == dtype and self.device.type == "cpu":
            out = torch.empty(ref.shape, dtype=dtype)
            self.ckpt.reader.read_into(ref, out)  # straight into the final buffer: no transient
        else:
            out = self.ckpt.reader.read(ref).to(device=self.device, dtype=dtype)
        check_tensor(out, name, ref.path, converted=ref.dtype != dtype)  # NaN/inf: refused at load
        if self.progress is not None:
            self.progress(ref.nbytes)
        self.resident_bytes += out.numel() * out.element_size()
        return out

    def linear_weight(self, prefix: str, out_features: int, in_features: int) -> torch.Tensor:
        """The [out, in] weight of the Linear at `prefix` in the compute dtype; a quantized one (per the
        checkpoint's quantization scheme) is read in its format and dequantized here, once, at load."""
        fmt = linear_format(self.ckpt, self.scheme, prefix)
        if is_stored_dense(fmt):
            return self.tensor(prefix + ".weight", (out_features, in_features))
        weight, stored_nbytes = dequantize_at_load(self.ckpt, fmt, prefix, (out_features, in_features), self.dtype)
        stored_in = self.ckpt.ref(fmt.stored_name(prefix, fmt.roles[0])).path
        check_tensor(weight, prefix, stored_in, note=f" ({fmt.name} weight, dequantized with its scales)")
        weight = weight.to(self.device)
        self.dequantized_linears.append(prefix)
        if self.progress is not None:
            self.progress(stored_nbytes)
        self.resident_bytes += weight.numel() * weight.element_size()
        return weight

    def make_linear(self, weight: torch.Tensor, b: torch.Tensor | None, quantize: bool = True) -> Linear:
        """A Linear of `weight` (already counted in resident_bytes at its loaded size); int8 when this load
        quantizes dense Linears and `quantize` (routers and gates pass False), with resident_bytes corrected."""
        lin = Linear(weight, b, self.cpp, int8=self.int8 and quantize)
        if lin.layout == "int8":
            self.int8_linears += 1
            self.resident_bytes += lin.nbytes - weight.numel() * weight.element_size() - (
                0 if b is None else b.numel() * b.element_size())
        return lin

    def linear(self, prefix: str, out_features: int, in_features: int, bias: bool = False,
               quantize: bool = True) -> Linear:
        weight = self.linear_weight(prefix, out_features, in_features)
        b = self.tensor(prefix + ".bias", (out_features,)) if bias else None
        return self.make_linear(weight, b, quantize)

    def stacked_linear(self, parts: list[tuple[str, int]], in_features: int, bias: bool = False) -> Linear:
        """One Linear whose output is the outputs of the Linears at `parts` ((prefix, out_features) each) side by
        side: their weights stacked along the output dim (one GEMV instead of several; each output row is the
        same dot product, so the same bits). Transient memory: the parts, once."""
        weight = torch.cat([self.linear_weight(p, out, in_features) for p, out in parts])
        b = torch.cat([self.tensor(p + ".bias", (out,)) for p, out in parts]) if bias else None
        return self.make_linear(weight, b)


@dataclass(frozen=True)
class ExpertPlan:
    """How experts are laid out in units and computed: the layout, the kernel, and per-expert sources."""

    layout: UnitLayout
    kernel: ExpertKernel
    sources: dict[tuple[int, int], tuple[FieldSources, ...]]
    description: str = "experts in the compute dtype"  # for the start-up log: format in each tier, kernel
    # Builds the unit reader; None = a plain ExpertSource (stored bytes copied, float dtypes converted).
    make_source: Callable[[Checkpoint], ExpertSource] | None = None

    def source(self, ckpt: Checkpoint) -> ExpertSource:
        if self.make_source is not None:
            return self.make_source(ckpt)
        return ExpertSource(ckpt, self.layout, self.sources)


def swiglu_expert_plan(ckpt: Checkpoint, arch: Architecture, spec: ModelSpec, dtype: torch.dtype) -> ExpertPlan:
    """Per-expert gate/up/down Linears (Qwen, Mixtral, OLMoE): unit = gate_up [2I, H] + down [H, I]."""
    names, h, i = arch.names, spec.hidden_size, spec.moe.intermediate_size
    layout = UnitLayout.build([("gate_up", dtype, (2 * i, h)), ("down", dtype, (h, i))])
    sources: dict[tuple[int, int], tuple[FieldSources, ...]] = {}
    for layer in spec.moe_layer_ids:
        for e in range(spec.moe.num_experts):
            gate, up, down = (ckpt.ref(t.format(L=layer, E=e) + ".weight", shape) for t, shape in
                              ((names.expert_gate, (i, h)), (names.expert_up, (i, h)), (names.expert_down, (h, i))))
            sources[(layer, e)] = (FieldSources("gate_up", (gate, up)), FieldSources("down", (down,)))
    return ExpertPlan(layout, swiglu_expert, sources)


# Expert kind (from ModelSpec.moe.expert_kind) -> the function that plans its units. Formats and architectures
# with other expert layouts register here; the model never branches on them.
EXPERT_PLANNERS: dict[str, Callable[[Checkpoint, Architecture, ModelSpec, torch.dtype], ExpertPlan]] = {
    "swiglu": swiglu_expert_plan,
}


def expert_plan(ckpt: Checkpoint, arch: Architecture, spec: ModelSpec, dtype: torch.dtype) -> ExpertPlan:
    from moeserve.models import expert_plans  # noqa: F401  (registers the quantized and gpt-oss planners)

    return EXPERT_PLANNERS[spec.moe.expert_kind](ckpt, arch, spec, dtype)


class MoeModel:
    def __init__(self, spec: ModelSpec, embed: torch.Tensor, layers: list[DecoderLayer], final_norm: torch.Tensor,
                 lm_head: torch.Tensor | Linear, store: ExpertStore, resident_bytes: int, cpp: bool = False) -> None:
        self.spec, self.embed, self.layers = spec, embed, layers
        self.final_norm, self.store = final_norm, store
        # An untied head is a Linear (bf16 GEMV packed at load, or int8, see Linear); a tied one shares the
        # embedding's plain tensor, which lookups need as it is (an int8 head is a quantized copy of it).
        if isinstance(lm_head, Linear):
            self._head: Linear | None = lm_head
        else:
            self._head = Linear(lm_head, cpp=cpp) if lm_head is not embed else None
        self._tied_head = embed if self._head is None else None
        self.resident_bytes = resident_bytes  # non-expert weights
        self.int8_summary = ""  # quantization="int8": what build_model quantized in the dense part, and why
        self.norm = RMS_NORMS[spec.norm_style][0]
        self.dequantized_linears: list[str] = []  # quantized dense Linears that were dequantized at load
        self.cpp = False  # norms and attention with the moeserve C++ ops: see use_cpp_kernels
        self.invariant = False  # batch-invariant numerics: see use_batch_invariance
        self.use_cpp_kernels(cpp)
        # Decode-only batches through every layer in one C++ call (models/decode_stack.py): see choose_decode_step.
        # The stack is built on first use for the KV cache it is given, and rebuilt if another one comes.
        self.fused_decode = False
        self._stack: Any = None
        self._stack_kv: KVCache | None = None
        self._stack_hits = torch.zeros(0, dtype=torch.int64)
        self._traced = False  # a trace hook is set: the per-op path runs (the hook sees each layer's routing)
        # For offloaded fused steps (models/decode_stack.fused_offloaded_step): the MoE layers in order, and where
        # a unit holds gate_up, down and their scales.
        blocks = [layer.mlp for layer in layers if isinstance(layer.mlp, MoEBlock)]
        self._moe_layer_ids = [b.layer for b in blocks]
        self._unit_fields = unit_fields(blocks[0].kernel) if blocks else (0, None, 1, None)

    def use_cpp_kernels(self, on: bool) -> bool:
        """Run norms and attention with the moeserve C++ ops (True) or the torch functions (False). The ops cover
        bf16 and fp32 on CPU; returns whether they are now in use."""
        on = on and self.embed.device.type == "cpu" and self.embed.dtype in (torch.bfloat16, torch.float32)
        self.cpp = on
        if not on:
            self.fused_decode = False  # the fused step is made of the C++ ops
        for layer in self.layers:
            layer.attn.cpp = on
            if isinstance(layer.mlp, MoEBlock):
                layer.mlp.cpp = on  # the fused expert op where the plan's kernel supports it
        return on

    def use_batch_invariance(self, on: bool) -> str:
        """Batch-invariant numerics (EngineSettings.batch_invariant) on every layer; returns the start-up log line."""
        for layer in self.layers:
            for part in (layer.attn, layer.mlp):
                part.invariant = on
                for lin in part.linears():
                    lin.invariant = on
        if self._head is not None:
            self._head.invariant = on
        self.invariant = on
        if not on:
            return "off (set): torch's batch-dependent GEMMs and attention where the C++ ops do not apply"
        block = choose_row_block()
        if not self.cpp:
            return (f"on (kernels=torch: GEMMs in fixed blocks of {block}, attention sequence by sequence; torch's "
                    "CPU norms and softmax reduce each row alone)")
        return f"on (every op reduces each row in one fixed order; torch fallbacks in fixed blocks of {block})"

    def choose_decode_step(self, want: str) -> str:
        """Decode-step path per EngineSettings.decode_step (auto, fused, per_op); returns the one-line reason for the
        start-up log; ConfigError when `fused` is asked for and cannot apply."""
        from moeserve.models.decode_stack import why_not_fused

        self.fused_decode, self._stack, self._stack_kv = False, None, None
        if want == "per_op":
            return "one op call per piece from Python (per_op, set)"
        why_not = why_not_fused(self)
        if why_not is not None:
            if want == "fused":
                raise ConfigError(f"decode_step=fused is not possible here: {why_not} (use auto or per_op)")
            return f"one op call per piece from Python ({why_not})"
        self.fused_decode = True
        how = ("one C++ call" if self.store.resident else
               "one C++ call, stopping at a MoE layer only when the store must read one of its experts"
               if self.store.calls_may_skip else "one C++ call, stopping at each MoE layer for the store's units")
        return (f"all {len(self.layers)} layers in {how} per decode-only batch "
                f"({'set' if want == 'fused' else 'auto'}; same ops, same bits as per_op, without the Python "
                "between them); prefill and mixed batches run per op")

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Logits (fp32) [num_seqs, vocab] of each sequence's last new token."""
        h = self.embed[batch.token_ids]  # [N, H]
        if (self.fused_decode and batch.decode_only and batch.token_slots is not None and not self._traced
                and (self.store.resident or batch.token_ids.shape[0] <= FUSED_MAX_TOKENS)):
            last = self._fused_step(h, batch, kv)
        elif self.cpp:
            last = self._layers_cpp(h, batch, kv)
        else:
            for layer in self.layers:
                h = layer(h, batch, kv)
            last = h[batch.last_token_index()]  # [B, H]
            last = self.norm(last, self.final_norm, self.spec.rms_norm_eps)
        if self._head is not None:
            return self._head(last).float()
        tied = functools.partial(torch.nn.functional.linear, weight=self.embed)  # tied: the head is the embedding
        return (in_row_blocks(tied, last) if self.invariant else tied(last)).float()

    def _fused_step(self, h: torch.Tensor, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Every layer in one DecodeStack call; the store is told the hits (one per needed expert per layer)."""
        from moeserve.models import decode_stack

        assert batch.token_slots is not None  # forward checked: a decode-only batch
        if self._stack is None or self._stack_kv is not kv:
            self._stack, self._stack_kv = decode_stack.fused_decode_stack(self, kv), kv
            self._stack_hits = torch.zeros(len(self.store.layers), dtype=torch.int64)
        if not self.store.resident:  # the store's own hits and misses
            return decode_stack.fused_offloaded_step(self._stack, self.store, self._moe_layer_ids,
                                                     self._unit_fields, h, batch.positions, batch.token_slots,
                                                     self._stack_hits)
        last = self._stack.step(h, batch.positions, batch.token_slots, self._stack_hits)
        self.store.count_resident_hits(self._stack_hits.tolist())
        self._stack_hits.zero_()
        return last

    def _layers_cpp(self, h: torch.Tensor, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """The decoder layers with each residual add fused into the norm that follows it; returns the final-
        normed hidden states of each sequence's last token [B, H]. Same operations as DecoderLayer."""
        ops, eps, fp32_scale = torch.ops.moeserve, self.spec.rms_norm_eps, self.spec.norm_style == "scale_in_fp32"
        layers = self.layers
        x = ops.rms_norm(h, layers[0].input_norm, eps, fp32_scale)
        for i, layer in enumerate(layers):
            x = ops.add_rms_norm_(h, layer.attn(x, batch, kv), layer.post_norm, eps, fp32_scale)  # h += attn
            m = layer.mlp(x)
            if i + 1 < len(layers):
                x = ops.add_rms_norm_(h, m, layers[i + 1].input_norm, eps, fp32_scale)  # h += mlp
            elif batch.decode_only:  # every token is its sequence's last
                return ops.add_rms_norm_(h, m, self.final_norm, eps, fp32_scale)
            else:
                h.add_(m)
        return ops.rms_norm(h[batch.last_token_index()], self.final_norm, eps, fp32_scale)

    @property
    def lm_head(self) -> torch.Tensor:
        """The LM head weight [vocab, H] as a plain tensor (a copy when packed)."""
        return self._head.weight if self._head is not None else self._tied_head  # type: ignore[return-value]

    def set_trace_hook(self, hook: Callable[[int, torch.Tensor, list[int] | None], None] | None) -> None:
        """Call `hook(layer, topk_ids [N, k], predicted next-layer experts or None)` in every MoE layer."""
        self._traced = hook is not None
        for layer in self.layers:
            if isinstance(layer.mlp, MoEBlock):
                layer.mlp.trace_hook = hook


def link_prefetch(layers: list[DecoderLayer]) -> None:
    """Give each MoE block the router of the next MoE block, so it can predict that layer's experts."""
    blocks = [layer.mlp for layer in layers if isinstance(layer.mlp, MoEBlock)]
    for block, nxt in zip(blocks, blocks[1:]):
        block.predict_next = (nxt.layer, nxt.router)


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
    cpp: bool = False,
    dense_int8: bool = False,
) -> MoeModel:
    """Stream the checkpoint into a MoeModel whose store holds `expert_capacity` experts in the fast tier.
    `cpp`: the moeserve C++ ops are loaded; dense Linears, norms and attention use them where they apply.
    `dense_int8` (quantization="int8"): with `cpp`, the dense Linears that every token reads in full (q/k/v, o,
    dense and shared-expert MLPs, LM head) become per-row int8 (see Linear); routers and the shared-expert gate
    stay in the compute dtype (tiny, and they pick the experts: a flipped choice costs more than their bytes
    save), and so does the embedding (a token reads one row of it)."""
    int8 = dense_int8 and cpp
    load = WeightLoader(ckpt, dtype, device, progress, cpp, int8)
    names, h = arch.names, spec.hidden_size
    store = ExpertStore(plan.source(ckpt), spec.moe_layer_ids, spec.moe.num_experts,
                        expert_capacity, device, cache_policy, progress,
                        store_options or StoreOptions(policy=cache_policy))
    rotary = Rotary(spec.rope, spec.attention.head_dim, max_len, dtype, device)
    embed = load.tensor(arch.names.embed, (spec.vocab_size, spec.hidden_size))
    layers = [_build_layer(load, arch, spec, L, rotary, store, plan.kernel) for L in range(spec.num_layers)]
    if store.prefetcher is not None:
        link_prefetch(layers)
    final_norm = load.tensor(names.final_norm, (h,), RMS_NORMS[spec.norm_style][1])
    lm_head: torch.Tensor | Linear
    if spec.tie_word_embeddings and not ckpt.has(names.lm_head + ".weight"):
        lm_head = embed
        if int8:  # an int8 copy of the tied table for the head; lookups keep the table itself
            load.resident_bytes += embed.numel() * embed.element_size()
            lm_head = load.make_linear(embed, None)
    else:
        lm_head = load.make_linear(load.linear_weight(names.lm_head, spec.vocab_size, h), None)
    model = MoeModel(spec, embed, layers, final_norm, lm_head, store, load.resident_bytes, cpp)
    model.dequantized_linears = load.dequantized_linears
    if int8 and load.int8_linears == 0:
        model.int8_summary = (f"kept in {str(dtype).removeprefix('torch.')}: the int8 dense GEMV takes bf16 "
                              "activations (and K % 32 == 0), so only the experts are int8")
    elif int8:
        model.int8_summary = (
            f"{load.int8_linears} Linears quantized to int8 with per-row float32 scales (q/k/v, o_proj, dense and "
            "shared-expert MLPs, LM head); kept in the compute dtype: routers and shared-expert gates (tiny, and "
            "they choose the experts), embedding (one row read per token), norms")
    elif dense_int8:
        model.int8_summary = ("kept in the compute dtype: the int8 dense GEMV needs the C++ kernels "
                              "(kernels=torch or unavailable), so only the experts are int8")
    return model


def _build_layer(load: WeightLoader, arch: Architecture, spec: ModelSpec, L: int, rotary: Rotary,
                 store: ExpertStore, kernel: ExpertKernel) -> DecoderLayer:
    """Read layer L's resident weights (attention, norms, router, dense or shared MLP)."""
    names, a, h = arch.names, spec.attention, spec.hidden_size

    def n(template: str) -> str:
        return template.format(L=L)

    q_norm = k_norm = None
    if a.qk_norm == "per_head":
        q_norm, k_norm = load.tensor(n(names.q_norm), (a.head_dim,)), load.tensor(n(names.k_norm), (a.head_dim,))
    elif a.qk_norm == "full":
        q_norm = load.tensor(n(names.q_norm), (a.num_heads * a.head_dim,))
        k_norm = load.tensor(n(names.k_norm), (a.num_kv_heads * a.head_dim,))
    attn = Attention(
        a, L,
        qkv=load.stacked_linear([(n(names.q_proj), a.num_heads * a.head_dim),
                                 (n(names.k_proj), a.num_kv_heads * a.head_dim),
                                 (n(names.v_proj), a.num_kv_heads * a.head_dim)], h, a.qkv_bias),
        o=load.linear(n(names.o_proj), h, a.num_heads * a.head_dim, a.o_bias),
        q_norm=q_norm, k_norm=k_norm,
        sinks=load.tensor(n(names.sinks), (a.num_heads,)) if a.sinks else None,
        rotary=rotary, eps=spec.rms_norm_eps,
    )
    mlp: DenseMLP | MoEBlock
    if spec.moe_layers[L]:
        m = spec.moe
        shared = shared_gate = None
        if m.shared_intermediate_size:
            si = m.shared_intermediate_size
            shared = DenseMLP(load.linear(n(names.shared_gate), si, h), load.linear(n(names.shared_up), si, h),
                              load.linear(n(names.shared_down), h, si))
            shared_gate = load.linear(n(names.shared_expert_gate), 1, h, quantize=False)
        router = load.linear(n(names.router), m.num_experts, h, m.router_bias, quantize=False)
        mlp = MoEBlock(m, L, router, store, kernel, shared, shared_gate)
    else:
        di = spec.dense_intermediate_size
        mlp = DenseMLP(load.linear(n(names.dense_gate), di, h), load.linear(n(names.dense_up), di, h),
                       load.linear(n(names.dense_down), h, di))
    norm, norm_dtype = RMS_NORMS[spec.norm_style]
    return DecoderLayer(attn, mlp, load.tensor(n(names.input_norm), (h,), norm_dtype),
                        load.tensor(n(names.post_norm), (h,), norm_dtype), spec.rms_norm_eps, norm)
