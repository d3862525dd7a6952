"""GGUF's quantized types as weight formats: one `Format` per ggml type moeserve reads (``gguf-q4_k``, ...).

A GGUF weight is one tensor, role ``weight``: uint8 ``[..., out, row_bytes]``, each row ``in / block_elems`` blocks
of the type (checkpoint/gguf/quants.py gives the layouts). Experts of a GGUF keep these bytes in every tier. The C++
expert op reads them as stored (`fused_codes`: csrc/gguf_codes.cpp decodes each block in registers to the bf16 cast
of what `dequantize` writes); the torch path dequantizes them at use through `dequantize`, exactly as the `gguf`
package's reference does, then rounds once into the compute dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from moeserve.checkpoint.gguf.quants import DEQUANTIZERS, TYPES_BY_NAME, GGMLType, dequantize
from moeserve.errors import CheckpointError
from moeserve.formats.base import Format, FusedCodes


@dataclass(frozen=True)
class GGUFFormat(Format):
    """A weight stored as blocks of one ggml type (the subclasses below fix the type)."""

    roles = ("weight",)
    ggml: ClassVar[GGMLType]

    def dequantized_shape(self, tensors: Mapping[str, Tensor]) -> tuple[int, ...]:
        w = tensors["weight"]
        row_bytes = w.shape[-1] * w.element_size()
        if w.dim() < 2 or row_bytes % self.ggml.block_bytes:
            raise CheckpointError(f"{self.name} weight of shape {tuple(w.shape)} does not hold whole "
                                  f"{self.ggml.block_bytes}-byte blocks per row")
        return (*w.shape[:-1], row_bytes // self.ggml.block_bytes * self.ggml.block_elems)

    def stored_shapes(self, shape: tuple[int, ...], dense_code: str) -> dict[str, tuple[str, tuple[int, ...]]]:
        if shape[-1] % self.ggml.block_elems:
            raise CheckpointError(f"{self.name}: rows of {shape[-1]} values do not hold whole "
                                  f"{self.ggml.block_elems}-value blocks")
        return {"weight": ("U8", (*shape[:-1], self.ggml.row_bytes(shape[-1])))}

    def dequantize(self, tensors: Mapping[str, Tensor], out: Tensor) -> None:
        out.copy_(dequantize(tensors["weight"], self.ggml).view(out.shape))

    def fused_codes(self) -> FusedCodes | None:
        if self.ggml.name not in FUSED_TYPES:
            return None
        return FusedCodes("gguf", 32, "weight", None, ggml=(self.ggml.name.lower(),))


# The ggml types the C++ expert op decodes (csrc/gguf_codes.cpp)
FUSED_TYPES = ("Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4")


def _format_class(type_name: str) -> type[GGUFFormat]:
    return type(f"GGUF{type_name}Format", (GGUFFormat,),
                {"name": f"gguf-{type_name.lower()}", "ggml": TYPES_BY_NAME[type_name], "__doc__":
                 f"GGUF {type_name} blocks."})


# ggml type name -> its Format class, for every quantized type with a dequantizer
GGUF_FORMATS: Mapping[str, type[GGUFFormat]] = {
    name: _format_class(name) for name in DEQUANTIZERS if not TYPES_BY_NAME[name].is_float}


@dataclass(frozen=True)
class LayerMixedGGUFFormat(Format):
    """One expert projection whose layers store different ggml types (llama.cpp's Q4_K_M gives some layers'
    ``ffn_down_exps`` Q6_K, others Q4_K). Not a stored format: a unit layout's view of them. Role ``weight`` is
    sized for the largest type's rows and a layer of a smaller type fills a prefix of it (the rest zeros); role
    ``type`` ([1] int32, written into each unit by its source: models/experts/sources.LayerTaggedSource) indexes
    `formats`, whose `dequantize` then decodes that prefix."""

    name: ClassVar[str] = "gguf-mixed"
    roles: ClassVar[tuple[str, ...]] = ("weight", "type")
    formats: tuple[GGUFFormat, ...] = ()

    def dequantized_shape(self, tensors: Mapping[str, Tensor]) -> tuple[int, ...]:
        w, big = tensors["weight"], self.largest
        return (*w.shape[:-1], w.shape[-1] // big.ggml.block_bytes * big.ggml.block_elems)

    @property
    def largest(self) -> GGUFFormat:
        """The type with the most bytes per value: the one the weight field is sized for."""
        return max(self.formats, key=lambda f: f.ggml.block_bytes / f.ggml.block_elems)

    def stored_shapes(self, shape: tuple[int, ...], dense_code: str) -> dict[str, tuple[str, tuple[int, ...]]]:
        return {"weight": self.largest.stored_shapes(shape, dense_code)["weight"], "type": ("I32", (1,))}

    def dequantize(self, tensors: Mapping[str, Tensor], out: Tensor) -> None:
        """Decode the prefix of the weight field that the unit's own type fills ([..., out, its row bytes])."""
        fmt, w = self.formats[int(tensors["type"][0])], tensors["weight"]
        row = fmt.ggml.row_bytes(out.shape[-1])
        prefix = w.reshape(-1)[: w.numel() // w.shape[-1] * row].view(*w.shape[:-1], row)
        fmt.dequantize({"weight": prefix}, out)

    def fused_codes(self) -> FusedCodes | None:
        """The op reads the unit's type index and decodes the prefix of that type (a formats' order)."""
        codes = [f.fused_codes() for f in self.formats]
        if any(c is None for c in codes):
            return None
        return FusedCodes("gguf", 32, "weight", None, ggml=tuple(c.ggml[0] for c in codes if c is not None),
                          type_role="type")
