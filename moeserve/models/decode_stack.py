"""The fused decode step: every decoder layer of a decode-only batch in one C++ call (csrc/decode_stack.cpp).

`fused_decode_stack(model, kv)` builds a `torch.classes.moeserve.DecodeStack` holding each layer's resident weights,
its KV cache views and the store's expert units, or says in one line why the model cannot use it. The stack calls
the same C++ functions as the per-op path (MoeModel._layers_cpp with Attention._cpp_attention and
MoEBlock._fused_interleaved) in the same order, so its logits are the same bits; what it saves is the Python and
the dispatcher between the ~10 ops of each layer (~12% of a batch-1 decode step on the small bench model).

It applies to: the C++ kernels on, bf16 compute on CPU, MoE layers without a shared expert (dense SwiGLU layers
too), attention without sinks, qkv clipping or a full-width q/k norm, dense Linears in the C++ GEMV layouts
(interleaved bf16 or int8), and experts either in a resident store as row-interleaved units (bf16 or int8: the
stack holds every unit) or offloaded (the store moves units between tiers: the stack stops at each MoE layer's
routing and `fused_offloaded_step` asks the store for the units, as MoEBlock does, then lets the stack go on;
row-interleaved or plain units, bf16 or int8), unless prefetch follows the caller's hints (those come from the
per-op path's next-layer router). Everything else runs the per-op path.
"""

from __future__ import annotations

from typing import Any

import torch

from moeserve.state.kv_cache import KVCache
from moeserve.models.layers import DenseMLP, Linear


def why_not_fused(model: Any) -> str | None:  # model: MoeModel (imported lazily by it: no import cycle)
    """None when `model` can run decode steps as one DecodeStack call, else the reason (one line)."""
    if not model.cpp:
        return "the C++ kernels are off"
    if model.embed.device.type != "cpu" or model.embed.dtype != torch.bfloat16:
        return "it runs bf16 on CPU only"
    store = model.store
    if not store.resident and store.prefetcher is not None and store.predictor is None:
        return "the store prefetches the caller's hints (prefetch_predictor='hint'), which the per-op path computes"
    a = model.spec.attention
    if a.sinks or a.clip_qkv is not None or a.qk_norm == "full":
        return "attention sinks, qkv clipping or a full-width q/k norm"
    gemv_layouts = ("interleaved", "int8")
    for layer in model.layers:
        mlp = layer.mlp
        dense: list[Linear] = [layer.attn.qkv, layer.attn.o]
        if isinstance(mlp, DenseMLP):
            if any(lin.bias is not None for lin in (mlp.gate, mlp.up, mlp.down)):
                return "a dense MLP with biases"
            dense += [mlp.gate, mlp.up, mlp.down]
        elif mlp.shared is not None:
            return "a shared expert"
        elif not getattr(mlp.kernel, "fused_interleaved", False) and (store.resident or not _plain_op(mlp.kernel)):
            return ("experts are not row-interleaved units (expert_layout=plain, or a kernel without the fused op)"
                    if store.resident else "experts in a layout without a fused C++ op")
        elif mlp.router.layout != "interleaved":
            return f"a router in the {mlp.router.layout!r} layout"
        for lin in dense:
            if lin.layout not in gemv_layouts:
                return f"a dense Linear in the {lin.layout!r} layout (the C++ GEMV layouts are needed)"
    return None


def _plain_op(kernel: Any) -> bool:
    """The expert kernel runs as moe_swiglu_ (bf16 SwiGLU units as [out, in] matrices) or moe_swiglu_int8_."""
    from moeserve.models.layers import swiglu_expert

    return kernel is swiglu_expert or getattr(kernel, "fused_int8_fields", None) is not None


def unit_fields(kernel: Any) -> tuple[int, int | None, int, int | None]:
    """Indices in a unit of (gate_up, its scales, down, its scales); no scales for bf16 units."""
    int8 = getattr(kernel, "fused_int8_fields", None)
    return (0, None, 1, None) if int8 is None else int8


def _scale(lin: Linear) -> torch.Tensor | None:
    return lin._scale if lin.layout == "int8" else None


def fused_decode_stack(model: Any, kv: KVCache) -> Any:
    """A DecodeStack for `model` writing into `kv` (call only when why_not_fused(model) is None)."""
    spec, a, layers = model.spec, model.spec.attention, model.layers
    stack = torch.classes.moeserve.DecodeStack(
        spec.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim, spec.moe.top_k,
        1 if spec.moe.routing == "topk_softmax" else 0, spec.moe.norm_topk_prob, spec.moe.weights_in_fp32,
        spec.rms_norm_eps, spec.norm_style == "scale_in_fp32", layers[0].attn.scale,
        layers[0].attn.rotary.cos, layers[0].attn.rotary.sin, model.final_norm)
    per_head = a.qk_norm == "per_head"
    for i, layer in enumerate(layers):
        attn, mlp = layer.attn, layer.mlp
        k_cache, v_cache = kv.layer(i)
        stack.add_layer(layer.input_norm, layer.post_norm, attn.qkv._weight, _scale(attn.qkv), attn.qkv.bias,
                        attn.o._weight, _scale(attn.o), attn.o.bias, attn.q_norm if per_head else None,
                        attn.k_norm if per_head else None, k_cache, v_cache, attn.window or 0)
        if isinstance(mlp, DenseMLP):
            stack.add_dense_mlp(*(t for lin in (mlp.gate, mlp.up, mlp.down) for t in (lin._weight, _scale(lin))))
            continue
        if not model.store.resident:  # the units come from the store at each step (fused_offloaded_step)
            stack.add_moe_external(mlp.router._weight, mlp.router.bias,
                                   not getattr(mlp.kernel, "fused_interleaved", False))
            continue
        units = model.store.resident_units(mlp.layer)
        int8 = getattr(mlp.kernel, "fused_int8_fields", None)
        if int8 is None:  # bf16 units: (gate_up, down)
            stack.add_moe(mlp.router._weight, mlp.router.bias, [u[0] for u in units], [], [u[1] for u in units], [])
        else:  # gate_up, its scales, down, its scales
            stack.add_moe(mlp.router._weight, mlp.router.bias, *([u[f] for u in units] for f in int8))
    store = model.store
    if store.calls_may_skip:  # layers whose experts are all cached run without stopping (fused_offloaded_step)
        assert store.layers == model._moe_layer_ids, "the store's layers are the MoE layers in order"
        slots = store.slot_units()
        stack.set_cached_units(*([] if f is None else [u[f] for u in slots] for f in model._unit_fields),
                               store.slot_table)
    return stack


def fused_offloaded_step(stack: Any, store: Any, moe_layers: list[int], fields: tuple[int, int | None, int, int | None],
                         h: torch.Tensor, positions: torch.Tensor, token_slots: torch.Tensor,
                         hits: torch.Tensor) -> torch.Tensor:
    """One decode step of a stack whose MoE layers are fed from the (offloaded) store: at a layer with an expert
    to read the store yields the needed units in chunks (loading misses, pinning what is in use) and the stack
    computes them; a layer whose experts are all cached runs in the stack, which logs the call for the store
    (set_cached_units, when the store allows it). `moe_layers`: the MoE layer ids in order; `fields`: unit_fields
    of the expert kernel."""
    gu, gus, dn, dns = fields
    ids = stack.begin(h, positions, token_slots, hits)
    while True:
        log = stack.take_cached_log()
        if log.numel():  # before the store's next call: its policy hears the calls in their order
            store.cached_calls(log.tolist())
        if ids.numel() == 0:
            return stack.result()
        for chunk in store.experts(moe_layers[stack.waiting_moe_index()], ids.tolist()):
            stack.feed([e for e, _ in chunk], [w[gu] for _, w in chunk],
                       [] if gus is None else [w[gus] for _, w in chunk], [w[dn] for _, w in chunk],
                       [] if dns is None else [w[dns] for _, w in chunk])
        ids = stack.resume()
