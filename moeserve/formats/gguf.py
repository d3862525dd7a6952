"""GGUF's quantized types as weight formats: one `Format` per ggml type moeserve reads (``gguf-q4_k``, ...).

A GGUF weight is one tensor, role ``weight``: uint8 ``[..., out, row_bytes]``, each row ``in / block_elems`` blocks
of the type (checkpoint/gguf/quants.py gives the layouts). Experts of a GGUF keep these bytes in every tier; the
expert kernel dequantizes them at use through `dequantize`, exactly as the `gguf` package's reference does, then
rounds once into the compute dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from moeserve.checkpoint.gguf.quants import DEQUANTIZERS, TYPES_BY_NAME, GGMLType, dequantize
from moeserve.errors import CheckpointError
from moeserve.formats.base import Format


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


def _format_class(type_name: str) -> type[GGUFFormat]:
    return type(f"GGUF{type_name}Format", (GGUFFormat,),
                {"name": f"gguf-{type_name.lower()}", "ggml": TYPES_BY_NAME[type_name], "__doc__":
                 f"GGUF {type_name} blocks."})


# ggml type name -> its Format class, for every quantized type with a dequantizer
GGUF_FORMATS: Mapping[str, type[GGUFFormat]] = {
    name: _format_class(name) for name in DEQUANTIZERS if not TYPES_BY_NAME[name].is_float}
