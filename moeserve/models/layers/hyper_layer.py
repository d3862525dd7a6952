"""A Qwen4-Exp decoder layer over the hyper-connection streams (models/layers/hyper.py), its PLE injection
(models/layers/ple.py) with the n-gram table rows (models/ngram.py), and the layer pass that carries the streams
from the embedding to the LM head:

    h = embedding repeated into S streams                    [N, S * H]
    per layer:  h += PLE(h)                  (PLE layers)
                x, w = attn_residual.read(h);  h = add(h, mixer(x), w)
                x, w = mlp_residual.read(h);   h = add(h, mlp(x), w)
    last = final_residual.read(h of each sequence's last token)       (no final norm)

Each PLE layer keeps per sequence its conv's last inputs and its last ngram_size - 1 token ids in the memory of
an `NgramState` group (layer id `state_layer`, past the model's layers: state/kinds.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from moeserve.models.layers.base import MLP, DecoderLayer, ForwardBatch, TokenMixer
from moeserve.models.layers.hyper import GatedResidual
from moeserve.models.layers.ple import PleInjection
from moeserve.models.ngram import NgramHash
from moeserve.models.passes import LayerPass
from moeserve.state.kv_cache import PagedKVCache


class PleLayer:
    """One layer's PLE: which rows (`hashing`), the table's rows [n, heads] -> [n, heads, head_dim] (`lookup`: through
    the table store, models/ngram_table.py), the injection, its state's layer id."""

    def __init__(self, hashing: NgramHash, lookup: Callable[[torch.Tensor], torch.Tensor], injection: PleInjection,
                 state_layer: int) -> None:
        self.hashing, self.lookup, self.injection, self.state_layer = hashing, lookup, injection, state_layer

    def __call__(self, h: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        conv, context = kv.recurrent(self.state_layer)
        slots = [table[0] for table in batch.tables[kv.group_of(self.state_layer)]]
        outs, off = [], 0
        for n, start, slot in zip(batch.num_new, batch.starts, slots):
            if start == 0:  # a new sequence: whatever the slot held before
                conv[slot].zero_()
                context[slot].copy_(self.hashing.start_context())
            tokens = batch.token_ids[off: off + n]
            before = context[slot].long()
            rows = self.hashing.rows(before, tokens)
            embedded = self.lookup(rows).flatten(-2)
            outs.append(self.injection(h[off: off + n], embedded, conv[slot]))
            context[slot].copy_(self.hashing.next_context(before, tokens))
            off += n
        return torch.cat(outs) if len(outs) > 1 else outs[0]


class HyperDecoderLayer(DecoderLayer):
    def __init__(self, attn: TokenMixer, mlp: MLP, attn_residual: GatedResidual, mlp_residual: GatedResidual,
                 ple: PleLayer | None) -> None:
        empty = torch.empty(0)
        super().__init__(attn, mlp, empty, empty, attn_residual.eps)
        self.attn_residual, self.mlp_residual, self.ple = attn_residual, mlp_residual, ple

    def __call__(self, h: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        if self.ple is not None:
            h = h + self.ple(h, batch, kv)
        x, weights = self.attn_residual.read(h)
        assert weights is not None
        h = GatedResidual.add(h, self.attn(x, batch, kv), weights)
        x, weights = self.mlp_residual.read(h)
        assert weights is not None
        return GatedResidual.add(h, self.mlp(x), weights)

    def why_not_stacked(self) -> str | None:
        return "hyper-connections (the fused decode step keeps one residual stream)"

    def add_to_stack(self, stack: Any, kv: PagedKVCache) -> None:
        raise NotImplementedError("why_not_stacked: never stacked")


class HyperLayers(LayerPass):
    """The layer pass of a model with hyper-connections (any numerics: its layers choose their ops)."""

    def __init__(self, layers: list[DecoderLayer], final: GatedResidual) -> None:
        self.layers, self.final = layers, final

    def run(self, h: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        h = h.repeat(1, self.final.streams)
        for layer in self.layers:
            h = layer(h, batch, kv)
        return self.final.read(h[batch.last_token_index()])[0]
