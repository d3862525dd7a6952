"""The n-gram tables of the PLE layers (ModelSpec.ngram) as units of an ExpertStore.

Each table is stored as row blocks (validate.ngram_table_shards: split_parts blocks of ceil(rows / parts) rows, the
last shorter). Each block is one unit: a single field [block_rows, head_dim] in the compute dtype, keyed (PLE layer,
block index). The store caches them under its policy, reads a miss from the checkpoint, and checks every re-read
against the checksum of its first read, exactly as for experts; a resident store (capacity >= blocks) loads all.

    table = NgramTable.build(ckpt, arch, spec, dtype, device, capacity)
    embedded = table.lookup(L, rows)             # rows [n, heads] -> [n, heads, head_dim]

A lookup asks the store for the blocks its rows fall in, ascending, and copies each row out of its block: pure
copies, so the result is the same bits whatever the capacity (offloaded == resident).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moeserve.experts.store import ExpertStore, StoreOptions
from moeserve.experts.unit import ExpertSource, FieldSources, UnitLayout
from moeserve.models.validate import ngram_table_shards

if TYPE_CHECKING:
    from moeserve.checkpoint.folder import Checkpoint
    from moeserve.models.registry import Architecture
    from moeserve.models.spec import ModelSpec

FIELD = "rows"


class TableSource(ExpertSource):
    """Row blocks of the n-gram tables as units (layer, block); a short last block's unit ends in zeros."""

    def read_unit(self, layer: int, expert: int, unit_bytes: torch.Tensor) -> None:
        if self._rows(layer, expert) < self.layout.fields[0].shape[0]:
            unit_bytes.zero_()  # the rows past a short block: the same bytes at every read (its checksum)
        super().read_unit(layer, expert, unit_bytes)

    def _rows(self, layer: int, expert: int) -> int:
        return sum(r.shape[0] for f in self.sources[(layer, expert)] for r in f.refs)

    def unit_name(self, layer: int, expert: int) -> str:
        return f"n-gram table row block {expert} of layer {layer}"


class NgramTable:
    """Every PLE layer's table, read through one store of row-block units."""

    def __init__(self, store: ExpertStore, block_rows: dict[int, int]) -> None:
        self.store, self.block_rows = store, block_rows  # each layer's rows per block (its table's own cut)

    @staticmethod
    def build(ckpt: Checkpoint, arch: Architecture, spec: ModelSpec, dtype: torch.dtype, device: torch.device,
              capacity: int | None, options: StoreOptions | None = None) -> NgramTable:
        """The store of every PLE layer's row blocks, `capacity` of them in memory (None: all, resident)."""
        ng = spec.ngram
        assert ng is not None
        shards = {L: ngram_table_shards(arch, spec, L) for L in ng.layers}
        block_rows = {L: b[0][1] for L, b in shards.items()}
        blocks = max(len(b) for b in shards.values())
        layout = UnitLayout.build([(FIELD, dtype, (max(block_rows.values()), ng.head_dim))])
        sources = {(L, i): (FieldSources(FIELD, (ckpt.tensors[name],)),)
                   for L, b in shards.items() for i, (name, _rows) in enumerate(b)}
        for L, b in shards.items():  # a table of fewer blocks (a smaller layer): its missing units are all zeros
            for i in range(len(b), blocks):
                sources[(L, i)] = ()
        total = blocks * len(shards)
        opts = options or StoreOptions(io_threads=0)
        store = ExpertStore(TableSource(ckpt, layout, sources), list(ng.layers), blocks,
                            total if capacity is None else capacity, device, opts.policy, None, opts)
        return NgramTable(store, block_rows)

    def lookup(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """The table rows `rows` [n, heads] (int64) of PLE layer `layer`: [n, heads, head_dim]."""
        flat = rows.reshape(-1)
        size = self.block_rows[layer]
        block, within = flat // size, flat % size
        needed = torch.unique(block).tolist()  # ascending
        field = self.store.layout.fields[0]
        out = torch.empty(flat.shape[0], field.shape[1], dtype=field.dtype, device=self.store.device)
        for chunk in self.store.experts(layer, needed):
            for b, (weights,) in chunk:
                picked = (block == b).nonzero().squeeze(-1)
                out[picked] = weights[within[picked]]
        return out.view(*rows.shape, field.shape[1])

    def close(self) -> None:
        self.store.close()
