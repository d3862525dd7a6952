"""The fused decode steps: every decoder layer of a decode-only batch in one C++ call (csrc/decode_stack.cpp).

A `torch.classes.moeserve.DecodeStack` holds each layer as a token mixer part and an FFN part (csrc/decode_stack.h:
one small C++ interface each; attention, Gated DeltaNet, MLA, Mamba-2, dense MLP and MoE are classes behind them).
Each Python layer part adds its own kind (`add_to_stack`) and says why it cannot (`why_not_stacked`). The stack
calls the same C++ functions and ATen ops as the per-op pass (passes.CppLayers with the mixers' C++ paths and the
expert kernel's op) in the same order and on the same shapes (the batch-invariant row blocks included), so its
logits are the same bits; what it saves is the Python and the dispatcher between the ~10-30 ops of each layer.

Two LayerPass implementations, chosen once by `choose_decode_step`:
- `FusedResident`: every expert unit is held by the stack; the store is told the hits after the step.
- `FusedOffloaded`: the stack stops at a MoE layer whose experts are not all cached and asks the store for the
  units (loading misses, pinning what is in use), then goes on; a layer whose experts are all cached runs inside
  the stack, which logs the call for the store (when the store allows it: ExpertStore.calls_may_skip).

It applies to: the C++ kernels on, bf16 compute on CPU, layer parts that can be stacked (see `why_not_stacked`):
attention (also gated, with a zero-centred per-head q/k norm; not with sinks, qkv clipping or a full-width q/k
norm), Gated DeltaNet (its recurrent step: a batch with a prompt token runs per op, `TokenMixer.stack_takes`),
Mamba-2 (its selective-state update; a batch with a prompt token runs per op), dense SwiGLU and relu2 MLPs, the
absent part of a one-part block (Nemotron-H), MoE blocks with a routing rule the stack has (softmax top-k, top-k
softmax, noaux_tc) and experts whose op it has (the fused SwiGLU op, or the relu2 experts' torch loop as ATen
ops), with or without a shared expert (SwiGLU or relu2, plain or sigmoid-gated); dense Linears in the C++ GEMV
layouts (an fp32 router as a plain matrix); multi-head latent attention (the absorbed form in its aligned query
blocks). Unless prefetch follows the caller's hints (computed by the per-op pass).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from moeserve.errors import ConfigError
from moeserve.models.experts.kernels import FUSED_MAX_TOKENS
from moeserve.models.layers.base import ForwardBatch, scales_in_fp32
from moeserve.models.passes import LayerPass
from moeserve.state.kv_cache import PagedKVCache

if TYPE_CHECKING:
    from moeserve.models.model import MoeModel


def why_not_fused(model: MoeModel) -> str | None:
    """None when `model` can run decode steps as one DecodeStack call, else the reason (one line)."""
    if not model.options.numerics.cpp:
        return "the C++ kernels are off"
    if model.embed.device.type != "cpu" or model.embed.dtype != torch.bfloat16:
        return "it runs bf16 on CPU only"
    store = model.store
    if store.takes_hints:
        return "the store prefetches the caller's hints (prefetch_predictor='hint'), which the per-op path computes"
    for layer in model.layers:
        why = layer.why_not_stacked()
        if why is not None:
            return why
    return None


class _Fused(LayerPass):
    """A DecodeStack built on first use for the KV cache it is given, and rebuilt if another one comes."""

    def __init__(self, model: MoeModel) -> None:
        self.model = model
        self._stack: Any = None
        self._kv: PagedKVCache | None = None
        self._hits = torch.zeros(len(model.store.layers), dtype=torch.int64)
        self._mixers = list({type(layer.attn): layer.attn for layer in model.layers}.values())  # one of each kind

    def accepts(self, batch: ForwardBatch) -> bool:
        return batch.decode_only and all(mixer.stack_takes(batch) for mixer in self._mixers)

    def stack(self, kv: PagedKVCache) -> Any:
        if self._stack is None or self._kv is not kv:
            self._stack, self._kv = self._build(kv), kv
        return self._stack

    def _build(self, kv: PagedKVCache) -> Any:
        model = self.model
        spec = model.spec
        row_block = model.options.numerics.invariant_rows  # the per-op path's torch row blocks (0: batch-variant)
        stack = torch.classes.moeserve.DecodeStack(spec.hidden_size, spec.rms_norm_eps,
                                                   scales_in_fp32(spec.norm_style), row_block, model.final_norm)
        for layer in model.layers:
            layer.add_to_stack(stack, kv)
        return stack


class FusedResident(_Fused):
    """Every unit held by the stack (a resident store's units never move)."""

    def run(self, h: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        last = self.stack(kv).step(h, batch.positions, batch.slot_mappings, batch.block_tables, self._hits)
        self.model.store.report_cached_calls(hits_per_layer=self._hits.tolist())
        self._hits.zero_()
        return last


class FusedOffloaded(_Fused):
    """MoE layers fed from the offloaded store at each step (decode-sized batches: see FUSED_MAX_TOKENS)."""

    def __init__(self, model: MoeModel) -> None:
        super().__init__(model)
        units = model.moe_blocks[0].experts.stack_units
        assert units is not None  # why_not_fused checked every layer
        self.fields = units.fields
        self.moe_layers = [b.layer for b in model.moe_blocks]
        assert model.store.layers == self.moe_layers, "the store's layers are the MoE layers in order"

    def accepts(self, batch: ForwardBatch) -> bool:
        return super().accepts(batch) and batch.token_ids.shape[0] <= FUSED_MAX_TOKENS

    def _build(self, kv: PagedKVCache) -> Any:
        stack = super()._build(kv)
        store = self.model.store
        if store.calls_may_skip:  # layers whose experts are all cached run without stopping
            slots = store.slot_units()
            stack.set_cached_units(*([] if f is None else [u[f] for u in slots] for f in self.fields),
                                   store.slot_table)
        return stack

    def run(self, h: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        """At a layer with an expert to read, the store yields the needed units in chunks and the stack computes
        them; cached-only layers are logged by the stack and reported to the store before its next call, so its
        policy hears the calls in their order."""
        stack, store = self.stack(kv), self.model.store
        gu, gus, dn, dns = self.fields
        ids = stack.begin(h, batch.positions, batch.slot_mappings, batch.block_tables, self._hits)
        while True:
            log = stack.take_cached_log()
            if log.numel():
                store.report_cached_calls(log.tolist())
            if ids.numel() == 0:
                return stack.result()
            for chunk in store.experts(self.moe_layers[stack.waiting_moe_index()], ids.tolist()):
                stack.feed([e for e, _ in chunk], [w[gu] for _, w in chunk],
                           [] if gus is None else [w[gus] for _, w in chunk], [w[dn] for _, w in chunk],
                           [] if dns is None else [w[dns] for _, w in chunk])
            ids = stack.resume()


def choose_decode_step(model: MoeModel, want: str) -> tuple[LayerPass | None, str]:
    """The decode step per EngineSettings.decode_step (auto, fused, per_op) and its one-line reason for the
    start-up log; None = decode batches run the model's layer pass. ConfigError when `fused` cannot apply."""
    if want == "per_op":
        return None, "one op call per piece from Python (per_op, set)"
    why_not = why_not_fused(model)
    if why_not is not None:
        if want == "fused":
            raise ConfigError(f"decode_step=fused is not possible here: {why_not} (use auto or per_op)")
        return None, f"one op call per piece from Python ({why_not})"
    store = model.store
    step: LayerPass = FusedResident(model) if store.resident else FusedOffloaded(model)
    how = ("one C++ call" if store.resident else
           "one C++ call, stopping at a MoE layer only when the store must read one of its experts"
           if store.calls_may_skip else "one C++ call, stopping at each MoE layer for the store's units")
    return step, (f"all {len(model.layers)} layers in {how} per decode-only batch "
                  f"({'set' if want == 'fused' else 'auto'}; same ops, same bits as per_op, without the Python "
                  "between them); prefill and mixed batches run per op")
