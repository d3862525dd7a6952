"""ExpertUnit: every tensor of one expert in ONE contiguous byte buffer, so an expert moves as one copy.

A `UnitLayout` lists the fields of a unit (name, dtype, shape, byte offset); it is the same for every expert of a
model. A field can be filled from several checkpoint tensors laid end to end (gate and up projections become one
``gate_up`` [2I, H] field, so the expert runs one GEMM for both). Quantized formats add their scale fields to the
same unit: nothing of an expert can be left behind in another tier.

`ExpertSource` reads unit bytes of (layer, expert) from the checkpoint, converting float dtypes when the compute
dtype differs from the stored one (through one staging buffer, sized once for the largest field).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moeserve.checkpoint.folder import Checkpoint
from moeserve.checkpoint.safetensors_file import TensorRef

ALIGN_BYTES = 64  # every field starts on a cache-line (and CUDA-friendly) boundary


@dataclass(frozen=True)
class UnitField:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the unit

    @property
    def nbytes(self) -> int:
        n = torch.empty((), dtype=self.dtype).element_size()
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class UnitLayout:
    fields: tuple[UnitField, ...]
    nbytes: int  # total, including alignment padding

    @staticmethod
    def build(specs: Sequence[tuple[str, torch.dtype, tuple[int, ...]]]) -> UnitLayout:
        fields, offset = [], 0
        for name, dtype, shape in specs:
            offset = -(-offset // ALIGN_BYTES) * ALIGN_BYTES
            field = UnitField(name, dtype, tuple(shape), offset)
            fields.append(field)
            offset += field.nbytes
        return UnitLayout(tuple(fields), -(-offset // ALIGN_BYTES) * ALIGN_BYTES)

    def field(self, name: str) -> UnitField:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(name)

    def views(self, unit_bytes: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Typed views of every field into one unit's bytes ([nbytes] uint8), in field order. No copies."""
        out = []
        for f in self.fields:
            raw = unit_bytes[f.offset : f.offset + f.nbytes]
            out.append(raw.view(f.dtype).view(f.shape))
        return tuple(out)


@dataclass(frozen=True)
class FieldSources:
    """The checkpoint tensors that, laid end to end along dim 0, fill one unit field."""

    field: str
    refs: tuple[TensorRef, ...]


class ExpertSource:
    """Reads expert units from a checkpoint on disk (the slowest tier).

    `sources[(layer, expert)]` lists, per unit field, the tensors to read. Reads go straight into the unit buffer
    when the stored dtype is the field dtype; otherwise through a staging buffer (one, reused, guarded by a lock so
    a background prefetch thread and the compute thread can share it).
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        layout: UnitLayout,
        sources: dict[tuple[int, int], tuple[FieldSources, ...]],
    ) -> None:
        self.checkpoint = checkpoint
        self.layout = layout
        self.sources = sources
        self._lock = threading.Lock()
        largest = max((r.nbytes for fs in sources.values() for f in fs for r in f.refs), default=0)
        needs_staging = any(
            r.dtype != layout.field(f.field).dtype for fs in sources.values() for f in fs for r in f.refs
        )
        self._staging = torch.empty(largest if needs_staging else 0, dtype=torch.uint8)

    @property
    def stored_nbytes(self) -> int:
        """Bytes one expert occupies on disk (what a miss reads)."""
        first = next(iter(self.sources.values()))
        return sum(r.nbytes for f in first for r in f.refs)

    @property
    def staging_nbytes(self) -> int:
        return self._staging.numel()

    def read_unit(self, layer: int, expert: int, unit_bytes: torch.Tensor) -> None:
        """Fill `unit_bytes` (a contiguous CPU uint8 tensor of layout.nbytes) with expert (layer, expert)."""
        reader = self.checkpoint.reader
        for fs in self.sources[(layer, expert)]:
            field = self.layout.field(fs.field)
            cursor = field.offset
            for ref in fs.refs:
                out_nbytes = ref.numel * field.nbytes // _numel(field.shape)
                dest = unit_bytes[cursor : cursor + out_nbytes]
                if ref.dtype == field.dtype:
                    reader.read_into(ref, dest)
                else:
                    with self._lock:
                        staged = self._staging[: ref.nbytes]
                        reader.read_into(ref, staged)
                        dest.view(field.dtype).copy_(staged.view(ref.dtype))
                cursor += out_nbytes


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
