"""How one forward pass runs the decoder layers: one `LayerPass` per way, chosen once when the model is built.

    last = pass_.run(h, batch, kv)   # the final-normed hidden states of each sequence's last new token [B, H]

- `TorchLayers`: each DecoderLayer in turn with torch norms (kernels=torch, CUDA).
- `CppLayers`: the same layers with each residual add fused into the norm that follows it (moeserve C++ ops).
- the fused decode steps of models/decode_stack.py: every layer of a decode-only batch in one C++ call.

MoeModel.forward runs its decode step when it `accepts` the batch, else its layer pass (which accepts every batch).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch

from moeserve.models.layers.base import DecoderLayer, ForwardBatch
from moeserve.state.kv_cache import PagedKVCache

Norm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


class LayerPass(ABC):
    """Runs every decoder layer over a batch; returns the final-normed last-token hidden states [B, H]."""

    def accepts(self, batch: ForwardBatch) -> bool:
        """Whether this pass can run `batch` (a layer pass runs any; a decode step only decode-only batches)."""
        return True

    @abstractmethod
    def run(self, h: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor: ...


class TorchLayers(LayerPass):
    def __init__(self, layers: Sequence[DecoderLayer], final_norm: torch.Tensor, norm: Norm, eps: float) -> None:
        self.layers, self.final_norm, self.norm, self.eps = list(layers), final_norm, norm, eps

    def run(self, h: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        for layer in self.layers:
            h = layer(h, batch, kv)
        return self.norm(h[batch.last_token_index()], self.final_norm, self.eps)


class CppLayers(LayerPass):
    """The operations of DecoderLayer, with `h += part; x = norm(h)` as one C++ op (csrc/norm.cpp)."""

    def __init__(self, layers: Sequence[DecoderLayer], final_norm: torch.Tensor, eps: float,
                 fp32_scale: bool) -> None:
        self.layers, self.final_norm, self.eps, self.fp32_scale = list(layers), final_norm, eps, fp32_scale

    def run(self, h: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        ops, eps, fp32_scale, layers = torch.ops.moeserve, self.eps, self.fp32_scale, self.layers
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
