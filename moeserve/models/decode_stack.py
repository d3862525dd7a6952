"""The fused decode step: every decoder layer of a decode-only batch in one C++ call (csrc/decode_stack.cpp).

`fused_decode_stack(model, kv)` builds a `torch.classes.moeserve.DecodeStack` holding each layer's resident weights,
its KV cache views and the store's expert units, or says in one line why the model cannot use it. The stack calls
the same C++ functions as the per-op path (MoeModel._layers_cpp with Attention._cpp_attention and
MoEBlock._fused_interleaved) in the same order, so its logits are the same bits; what it saves is the Python and
the dispatcher between the ~10 ops of each layer (~12% of a batch-1 decode step on the small bench model).

It applies to: the C++ kernels on, bf16 compute on CPU, experts in a resident store as row-interleaved units (bf16
or int8), MoE layers without a shared expert (dense SwiGLU layers too), attention without sinks, qkv clipping or a full-width
q/k norm, dense Linears in the C++ GEMV layouts (interleaved bf16 or int8). Everything else runs the per-op path.
"""

from __future__ import annotations

from typing import Any

import torch

from moeserve.engine.kv_cache import KVCache
from moeserve.models.layers import DenseMLP, Linear


def why_not_fused(model: Any) -> str | None:  # model: MoeModel (imported lazily by it: no import cycle)
    """None when `model` can run decode steps as one DecodeStack call, else the reason (one line)."""
    if not model.cpp:
        return "the C++ kernels are off"
    if model.embed.device.type != "cpu" or model.embed.dtype != torch.bfloat16:
        return "it runs bf16 on CPU only"
    if not model.store.resident:
        return "experts are offloaded (the store moves units between tiers)"
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
        elif not getattr(mlp.kernel, "fused_interleaved", False):
            return "experts are not row-interleaved units (expert_layout=plain, or a kernel without the fused op)"
        elif mlp.router.layout != "interleaved":
            return f"a router in the {mlp.router.layout!r} layout"
        for lin in dense:
            if lin.layout not in gemv_layouts:
                return f"a dense Linear in the {lin.layout!r} layout (the C++ GEMV layouts are needed)"
    return None


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
        units = model.store.resident_units(mlp.layer)
        int8 = getattr(mlp.kernel, "fused_int8_fields", None)
        if int8 is None:  # bf16 units: (gate_up, down)
            stack.add_moe(mlp.router._weight, mlp.router.bias, [u[0] for u in units], [], [u[1] for u in units], [])
        else:  # gate_up, its scales, down, its scales
            stack.add_moe(mlp.router._weight, mlp.router.bias, *([u[f] for u in units] for f in int8))
    return stack
