"""Expert sources that transform the dense units of a 16/32-bit checkpoint as they are read: int8 and int4 on load,
and row-interleaved SwiGLU and gpt-oss units. Each wraps the dense plan's ExpertSource and is deterministic, so a re-read after an
eviction gives the same bytes and offloading stays bit-exact (experts/verify.py checks it)."""

from __future__ import annotations

import inspect
import json
import threading
from functools import partial
from pathlib import Path

import torch

from moeserve.checkpoint.finite import check_expert_unit
from moeserve.checkpoint.folder import Checkpoint
from moeserve.checkpoint.safetensors_file import Placer, TensorRef
from moeserve.experts.spill import UnitSpill, fingerprint, open_or_build
from moeserve.experts.unit import ExpertSource, FieldSources, UnitLayout
from moeserve.formats.int4 import quantize_int4_packed
from moeserve.formats.int8 import quantize_int8_per_channel
from moeserve.models.layers.linear import pack_int8_rows


class QuantizedOnLoadSource(ExpertSource):
    """Reads an expert of a 16/32-bit checkpoint through the dense plan, then writes it into a unit of a quantized
    layout (`fill`: int8 or int4 on load). The result is deterministic, so a re-read after eviction gives the same
    bytes and offloading stays bit-exact.

    Offloaded (`prepare_offload`), every unit is quantized once during the load and written to a spill file
    under `spill_root` (see `moeserve.experts.spill`); misses then read the quantized unit from it: fewer bytes
    than the 16-bit expert, and no quantization per miss. The spill holds the very bytes a miss would make.
    """

    what = "quantized"  # for the log lines: "int8", "int4"
    quantizer: object = None  # the function that makes the codes: its source is part of the spill's fingerprint

    def __init__(self, dense: ExpertSource, layout: UnitLayout, spill_root: Path | None = None) -> None:
        super().__init__(dense.checkpoint, layout, dense.sources)
        self.dense_source = dense
        self._scratch = torch.empty(dense.layout.nbytes, dtype=torch.uint8)
        self._scratch_lock = threading.Lock()
        self.spill_root = spill_root
        self.spill: UnitSpill | None = None

    def fill(self, dense: tuple[torch.Tensor, ...], out: tuple[torch.Tensor, ...]) -> None:
        """Write the unit's fields `out` from the dense unit's fields."""
        raise NotImplementedError

    @property
    def staging_nbytes(self) -> int:
        return super().staging_nbytes + self._scratch.numel()  # + the 16/32-bit unit each quantization reads into

    @property
    def stored_nbytes(self) -> int:
        """Bytes a miss reads: the quantized unit from the spill file, else the 16/32-bit expert."""
        return self.layout.nbytes if self.spill is not None else super().stored_nbytes

    def prepare_offload(self) -> str | None:
        if self.spill_root is None:
            return f"{self.what} misses read the 16-bit expert and quantize it (spill file off)"
        files = sorted({r.path for fs in self.sources.values() for f in fs for r in f.refs})
        how = "|".join((inspect.getsource(self.quantizer), torch.__version__, repr(self.layout),  # type: ignore[arg-type]
                        repr(self.dense_source.layout), json.dumps(self.checkpoint.config, sort_keys=True)))
        self.spill = open_or_build(self.spill_root, fingerprint(files, how), sorted(self.sources),
                                   self.layout.nbytes, lambda key, out: self.quantize_unit(*key, out),
                                   f"{self.what} experts")
        if self.spill is None:
            return f"{self.what} misses read the 16-bit expert and quantize it (no spill file)"
        return f"{self.what} misses read from the spill file {self.spill.path}"

    def unit_files(self, layer: int, expert: int) -> str:
        return str(self.spill.path) if self.spill is not None else super().unit_files(layer, expert)

    def corrupt_advice(self, layer: int, expert: int) -> str:
        if self.spill is None:
            return super().corrupt_advice(layer, expert)
        return "delete it and restart the server (it is made again from the checkpoint)"

    def known_checksums(self) -> tuple[str, dict[tuple[int, int], int]]:
        """The spill header's per-unit checksums, written when the units were made at load."""
        if self.spill is None:
            return "", {}
        return self.spill.checksum_name, self.spill.checksums()

    def read_unit(self, layer: int, expert: int, unit_bytes: torch.Tensor) -> None:
        if self.spill is not None:
            self.spill.read_unit((layer, expert), unit_bytes)
        else:
            self.quantize_unit(layer, expert, unit_bytes)

    def quantize_unit(self, layer: int, expert: int, unit_bytes: torch.Tensor) -> None:
        with self._scratch_lock:
            self.dense_source.read_unit(layer, expert, self._scratch)
            # quantization turns NaN into finite codes: check what it reads. The resident load and the spill
            # build quantize every expert during the load; a miss without a spill file pays 0.8 ms against 14 ms
            # of int8 quantization (a 9.4 MB bf16 Qwen3-30B expert, one thread, measured here).
            check_expert_unit(self.dense_source, layer, expert, self._scratch)
            self.fill(self.dense_source.layout.views(self._scratch), self.layout.views(unit_bytes))

    def close(self) -> None:
        if self.spill is not None:
            self.spill.close()
        super().close()
        self.dense_source.close()
        self._scratch = torch.empty(0, dtype=torch.uint8)


class Int8ExpertSource(QuantizedOnLoadSource):
    """quantization="int8": every matrix field to int8 with one float32 scale per row (row-interleaved where the
    layout is flat), other fields copied."""

    what = "int8"
    quantizer = staticmethod(quantize_int8_per_channel)

    def __init__(
        self,
        dense: ExpertSource,
        int8_layout: UnitLayout,
        targets: tuple[tuple[int, int | None], ...],
        spill_root: Path | None = None,
    ) -> None:
        super().__init__(dense, int8_layout, spill_root)
        self.targets = (
            targets  # per dense field: (int8 field index, scale field index or None = copied as is)
        )

    def fill(self, dense: tuple[torch.Tensor, ...], out: tuple[torch.Tensor, ...]) -> None:
        for field, (index, scale_index) in zip(dense, self.targets):
            if scale_index is None:
                out[index].copy_(field)
            else:
                codes, scale = quantize_int8_per_channel(field)
                out[index].copy_(pack_int8_rows(codes) if out[index].dim() == 1 else codes)
                out[scale_index].copy_(scale)


class Int4ExpertSource(QuantizedOnLoadSource):
    """quantization="int4": every matrix field ([out, in], or [in, out] where `transposed`) to compressed-tensors'
    pack-quantized int4 (weight_packed, weight_scale, weight_shape: formats/int4.py), other fields copied.
    `targets`: per dense field, (its field in the int4 unit, or the first of its three; transposed; matrix)."""

    what = "int4"
    quantizer = staticmethod(quantize_int4_packed)

    def __init__(self, dense: ExpertSource, layout: UnitLayout, targets: tuple[tuple[int, bool, bool], ...],
                 group: int, spill_root: Path | None = None) -> None:
        super().__init__(dense, layout, spill_root)
        self.targets, self.group = targets, group

    def fill(self, dense: tuple[torch.Tensor, ...], out: tuple[torch.Tensor, ...]) -> None:
        for field, (index, transposed, matrix) in zip(dense, self.targets):
            if not matrix:
                out[index].copy_(field)
                continue
            packed, scale = quantize_int4_packed(field.t() if transposed else field, self.group)
            out[index].copy_(packed)
            out[index + 1].copy_(scale)
            out[index + 2].copy_(torch.tensor([packed.shape[0], packed.shape[1] * 8]))


class InterleavedExpertSource(ExpertSource):
    """Reads a SwiGLU unit and writes both matrices row-interleaved (blocks of 4 rows never straddle gate and up:
    I % 4 == 0, so each stored tensor is interleaved on its own); `transposed` (gpt-oss): the matrices are stored
    [in, out] and interleaved as [out, in], 1-D fields (biases) copied as they are. Where the checkpoint stores the
    compute dtype, the permutation IS the copy out of the read buffer (`placer`: one single-threaded C++ pass per
    tensor, run on the store's I/O threads); otherwise the expert is read and converted through the dense plan's
    source into a per-thread scratch unit first. Deterministic, so a re-read after eviction gives the same bytes.
    Needs the C++ kernels (as the layout does)."""

    def __init__(self, dense: ExpertSource, layout: UnitLayout, transposed: bool = False) -> None:
        super().__init__(dense.checkpoint, layout, dense.sources)
        self.dense_source = dense
        self.transposed = transposed
        # every stored tensor in the field dtype: placed straight from the read buffer, no scratch unit
        self._placed = all(r.dtype == layout.field(f.field).dtype for fs in dense.sources.values() for f in fs
                           for r in f.refs)
        self._local = threading.local()  # scratch per thread otherwise: the store reads on several threads

    @property
    def per_thread_staging_nbytes(self) -> int:
        return 0 if self._placed else self.dense_source.layout.nbytes

    def close(self) -> None:
        super().close()
        self.dense_source.close()
        self._local = threading.local()  # the scratch units of threads still running (the compute thread's)

    def placer(self, field: str, ref: TensorRef) -> Placer | None:
        if len(ref.shape) != 2:
            return None
        return partial(_interleave_placed, ref.shape, self.transposed)

    def read_unit(self, layer: int, expert: int, unit_bytes: torch.Tensor) -> None:
        if self._placed:
            super().read_unit(layer, expert, unit_bytes)
            return
        scratch = getattr(self._local, "unit", None)
        if scratch is None:
            scratch = self._local.unit = torch.empty(self.dense_source.layout.nbytes, dtype=torch.uint8)
        self.dense_source.read_unit(layer, expert, scratch)
        for plain, flat in zip(self.dense_source.layout.views(scratch), self.layout.views(unit_bytes)):
            if plain.dim() != 2:
                flat.copy_(plain)
                continue
            # one thread (csrc/layout*.cpp): a torch permute-copy here would start an OpenMP team per I/O thread
            _interleave(flat, plain, self.transposed)


def _interleave(dst: torch.Tensor, src: torch.Tensor, transposed: bool) -> None:
    """dst (flat, 2-byte) = src [N, K] row-interleaved, or src^T for a `transposed` src [K, N]."""
    ops = torch.ops.moeserve
    (ops.interleave_transposed_into if transposed else ops.interleave_rows_into)(dst, src)


def _interleave_placed(shape: tuple[int, ...], transposed: bool, dst: torch.Tensor, stored: torch.Tensor) -> None:
    """Placer of InterleavedExpertSource: `stored` (uint8, the bytes of a 2-byte matrix of `shape`) row-interleaved
    into `dst` (uint8, as many bytes)."""
    if stored.storage_offset() % 2:  # a tensor at an odd file offset: 2-byte views need an even start
        stored = stored.clone()
    _interleave(dst.view(torch.int16), stored.view(torch.int16).view(shape), transposed)


class LayerTaggedSource(ExpertSource):
    """Reads units whose projections change ggml type across layers (formats/gguf.LayerMixedGGUFFormat): the stored
    blocks fill a prefix of their field as the plain source reads them; the rest of the field is zeroed (a re-read
    gives the same bytes) and each `tags` field ([1] int32) gets the layer's type index."""

    def __init__(self, checkpoint: Checkpoint, layout: UnitLayout,
                 sources: dict[tuple[int, int], tuple[FieldSources, ...]], tags: dict[str, dict[int, int]],
                 padded: tuple[str, ...]) -> None:
        super().__init__(checkpoint, layout, sources)
        self.tags = {layout.field(name): by_layer for name, by_layer in tags.items()}
        self.padded = {name: layout.field(name) for name in padded}

    def read_unit(self, layer: int, expert: int, unit_bytes: torch.Tensor) -> None:
        super().read_unit(layer, expert, unit_bytes)
        for fs in self.sources[(layer, expert)]:
            field = self.padded.get(fs.field)
            if field is not None:
                unit_bytes[field.offset + sum(r.nbytes for r in fs.refs) : field.offset + field.nbytes].zero_()
        for field, by_layer in self.tags.items():
            unit_bytes[field.offset : field.offset + field.nbytes].view(field.dtype)[0] = by_layer[layer]
