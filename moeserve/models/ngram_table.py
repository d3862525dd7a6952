"""The n-gram tables of the PLE layers (ModelSpec.ngram) as units of an ExpertStore.

Each table is stored as row blocks (validate.ngram_table_shards: split_parts blocks of ceil(rows / parts) rows, the
last shorter; 200 MB each in the flagship). The store's units are cut finer: `unit_rows` rows each (one page), a
single field [unit_rows, head_dim] in the compute dtype, keyed (PLE layer, unit index), their bytes the matching row
ranges of the stored blocks (`unit_refs`). The store caches them under its policy, reads a miss from the checkpoint, and checks every re-read
against the checksum of its first read, exactly as for experts; a resident store (capacity >= blocks) loads all.

    table = NgramTable.build(ckpt, arch, spec, dtype, device, capacity)
    embedded = table.lookup(L, rows)             # rows [n, heads] -> [n, heads, head_dim]

A lookup asks the store for the blocks its rows fall in, ascending, and copies each row out of its block: pure
copies, so the result is the same bits whatever the capacity (offloaded == resident).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from moeserve.experts.store import ExpertStore, StoreOptions
from moeserve.experts.unit import ExpertSource, FieldSources, UnitLayout
from moeserve.models.validate import ngram_table_shards

if TYPE_CHECKING:
    from moeserve.checkpoint.folder import Checkpoint
    from moeserve.checkpoint.safetensors_file import TensorRef
    from moeserve.models.registry import Architecture
    from moeserve.models.spec import ModelSpec

FIELD = "rows"


UNIT_BYTES = 4096  # a unit's target size: one page (a token reads a few rows at random; a larger unit only costs reads)


def unit_rows(row_bytes: int) -> tuple[int, str]:
    """(rows per unit, why): as many rows as fill UNIT_BYTES, at least one."""
    rows = max(1, UNIT_BYTES // row_bytes)
    return rows, (f"{rows} rows ({rows * row_bytes} bytes) per unit: one {UNIT_BYTES}-byte page, as a token reads "
                  "a few rows at random")


def _row_range(ref: TensorRef, start: int, stop: int) -> TensorRef:
    """Rows [start, stop) of a stored 2-D tensor: one byte range."""
    row = ref.nbytes // ref.shape[0]
    return replace(ref, name=f"{ref.name}[{start}:{stop}]", offset=ref.offset + start * row,
                   nbytes=(stop - start) * row, shape=(stop - start, *ref.shape[1:]))


class UnitRefs(Mapping[tuple[int, int], tuple[FieldSources, ...]]):
    """Each unit's stored byte ranges, computed when asked (the flagship has ~1.6 M units a table): unit (L, u) holds
    rows [u * per_unit, (u + 1) * per_unit) of layer L's table, stored as row blocks laid end to end, so a unit
    may span the end of one block and the start of the next. A unit past a smaller table's end has none."""

    def __init__(self, shards: dict[int, list[TensorRef]], per_unit: int) -> None:
        self.shards, self.per_unit = shards, per_unit
        self.rows = {L: sum(r.shape[0] for r in refs) for L, refs in shards.items()}
        self.firsts = {L: [sum(r.shape[0] for r in refs[:i]) for i in range(len(refs))] for L, refs in shards.items()}
        self.units = -(-max(self.rows.values()) // per_unit)

    def __getitem__(self, key: tuple[int, int]) -> tuple[FieldSources, ...]:
        L, u = key
        if L not in self.shards or not 0 <= u < self.units:
            raise KeyError(key)
        start = u * self.per_unit
        stop, refs = min(self.rows[L], start + self.per_unit), []
        for first, ref in zip(self.firsts[L], self.shards[L]):
            lo, hi = max(start, first), min(stop, first + ref.shape[0])
            if lo < hi:
                refs.append(_row_range(ref, lo - first, hi - first))
        return (FieldSources(FIELD, tuple(refs)),) if refs else ()

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return ((L, u) for L in self.shards for u in range(self.units))

    def __len__(self) -> int:
        return len(self.shards) * self.units


class TableSource(ExpertSource):
    """Row ranges of the n-gram tables as units (layer, unit index); a short last unit ends in zeros."""

    def __init__(self, checkpoint: Checkpoint, layout: UnitLayout, units: UnitRefs) -> None:
        first = next(iter(units))
        super().__init__(checkpoint, layout, {first: units[first]})  # not every unit: there are millions
        self.sources = units  # type: ignore[assignment]
        stored = units.shards[first[0]][0]
        if stored.dtype != layout.fields[0].dtype:  # staging for the dtype conversion: the largest range, one unit
            self._staging = torch.empty(units.per_unit * stored.nbytes // stored.shape[0], dtype=torch.uint8)

    def read_unit(self, layer: int, expert: int, unit_bytes: torch.Tensor) -> None:
        if sum(r.shape[0] for f in self.sources[(layer, expert)] for r in f.refs) < self.layout.fields[0].shape[0]:
            unit_bytes.zero_()  # the rows past a short unit: the same bytes at every read (its checksum)
        super().read_unit(layer, expert, unit_bytes)

    def unit_name(self, layer: int, expert: int) -> str:
        rows = self.layout.fields[0].shape[0]
        return f"n-gram table unit {expert} (rows {expert * rows}-{(expert + 1) * rows - 1}) of layer {layer}"


def table_units(spec: ModelSpec, dtype: torch.dtype) -> tuple[int, int, int]:
    """(units of every PLE layer's table, bytes of one unit, bytes of the tables in `dtype`), from the spec alone."""
    ng = spec.ngram
    assert ng is not None
    per_unit, _why = unit_rows(ng.head_dim * dtype.itemsize)
    layout = UnitLayout.build([(FIELD, dtype, (per_unit, ng.head_dim))])
    return (len(ng.layers) * -(-max(ng.rows) // per_unit), layout.nbytes,
            sum(ng.rows) * ng.head_dim * dtype.itemsize)


class NgramTable:
    """Every PLE layer's table, read through one store of row-range units."""

    def __init__(self, store: ExpertStore, per_unit: int) -> None:
        self.store, self.per_unit = store, per_unit

    @staticmethod
    def build(ckpt: Checkpoint, arch: Architecture, spec: ModelSpec, dtype: torch.dtype, device: torch.device,
              capacity: int | None, options: StoreOptions | None = None) -> NgramTable:
        """The store of every PLE layer's row-range units, `capacity` of them in memory (None: all, resident)."""
        ng = spec.ngram
        assert ng is not None
        per_unit, _why = unit_rows(ng.head_dim * dtype.itemsize)
        layout = UnitLayout.build([(FIELD, dtype, (per_unit, ng.head_dim))])
        units = UnitRefs({L: [ckpt.tensors[name] for name, _rows in ngram_table_shards(arch, spec, L)]
                          for L in ng.layers}, per_unit)
        opts = options or StoreOptions(io_threads=0)
        store = ExpertStore(TableSource(ckpt, layout, units), list(ng.layers), units.units,
                            len(units) if capacity is None else capacity, device, opts.policy, None, opts)
        return NgramTable(store, per_unit)

    def lookup(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """The table rows `rows` [n, heads] (int64) of PLE layer `layer`: [n, heads, head_dim]."""
        flat = rows.reshape(-1)
        block, within = flat // self.per_unit, flat % self.per_unit
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
