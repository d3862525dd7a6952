"""Every stored-weight `Format` moeserve reads, and the registry that maps a format name to its class.

The classes are thin adapters from roles to the pure functions in the per-format modules.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from moeserve.errors import CheckpointError, UnsupportedModelError
from moeserve.formats.base import Format, FusedCodes
from moeserve.formats.fp8_block import DEFAULT_BLOCK_SIZE, dequantize_fp8_block, fp8_block_scale_shape
from moeserve.formats.gguf import GGUF_FORMATS
from moeserve.formats.int4 import (
    INT4_DEFAULT_GROUP_SIZE,
    INT4_PER_WORD,
    dequantize_int4_packed,
    int4_output_shape,
)
from moeserve.formats.int8 import dequantize_int8_per_channel
from moeserve.formats.mxfp4 import MXFP4_GROUP_SIZE, dequantize_mxfp4, mxfp4_output_shape
from moeserve.formats.nvfp4 import (
    NVFP4_GROUP_SIZE,
    dequantize_nvfp4_ct,
    dequantize_nvfp4_modelopt,
    nvfp4_output_shape,
)


def _fp4_shapes(
    roles: tuple[str, ...],
    shape: tuple[int, ...],
    group: tuple[str, int],
    global_shape: tuple[int, ...] | None,
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Stored tensors of a packed 4-bit weight [..., out, in]: codes two per byte, one scale (`group`: its dtype
    code and the elements it covers) per group along `in`, and an optional float32 global scale."""
    *rows, cols = shape
    code, size = group
    out = {roles[0]: ("U8", (*rows, cols // 2)), roles[1]: (code, (*rows, cols // size))}
    if global_shape is not None:
        out[roles[2]] = ("F32", global_shape)
    return out


@dataclass(frozen=True)
class DenseFormat(Format):
    """An unquantized ``weight`` (any float dtype): dequantizing is a copy with a dtype cast."""

    name = "dense"
    roles = ("weight",)

    def dequantized_shape(self, tensors: Mapping[str, Tensor]) -> tuple[int, ...]:
        return tuple(tensors["weight"].shape)

    def stored_shapes(
        self, shape: tuple[int, ...], dense_code: str
    ) -> dict[str, tuple[str, tuple[int, ...]]]:
        return {"weight": (dense_code, shape)}

    def dequantize(self, tensors: Mapping[str, Tensor], out: Tensor) -> None:
        out.copy_(tensors["weight"])


@dataclass(frozen=True)
class GptOssMxfp4Format(Format):
    """gpt-oss HF experts: ``{prefix}_blocks`` uint8 ``[E, R, G, 16]`` + ``{prefix}_scales`` ``[E, R, G]``.

    Dense shape ``[E, R, G*32]`` (out features x in features per expert, NOT transformers' ``[E, in, out]``).
    """

    name = "mxfp4-gpt-oss"
    roles = ("blocks", "scales")
    separator = "_"

    def dequantized_shape(self, tensors: Mapping[str, Tensor]) -> tuple[int, ...]:
        return mxfp4_output_shape(tensors["blocks"], tensors["scales"])

    def stored_shapes(
        self, shape: tuple[int, ...], dense_code: str
    ) -> dict[str, tuple[str, tuple[int, ...]]]:
        groups = (*shape[:-1], shape[-1] // MXFP4_GROUP_SIZE)  # one E8M0 scale per 32 values
        return {"blocks": ("U8", (*groups, MXFP4_GROUP_SIZE // 2)), "scales": ("U8", groups)}

    def dequantize(self, tensors: Mapping[str, Tensor], out: Tensor) -> None:
        dequantize_mxfp4(tensors["blocks"], tensors["scales"], out)

    def fused_codes(self) -> FusedCodes:
        return FusedCodes("mxfp4", MXFP4_GROUP_SIZE, "blocks", "scales")


@dataclass(frozen=True)
class CompressedTensorsMxfp4Format(Format):
    """compressed-tensors ``mxfp4-pack-quantized``: ``weight_packed`` ``[out, in/2]``, ``weight_scale`` E8M0."""

    name = "mxfp4-ct"
    roles = ("weight_packed", "weight_scale")

    def dequantized_shape(self, tensors: Mapping[str, Tensor]) -> tuple[int, ...]:
        return mxfp4_output_shape(tensors["weight_packed"], tensors["weight_scale"])

    def stored_shapes(
        self, shape: tuple[int, ...], dense_code: str
    ) -> dict[str, tuple[str, tuple[int, ...]]]:
        return _fp4_shapes(self.roles, shape, ("U8", MXFP4_GROUP_SIZE), None)

    def dequantize(self, tensors: Mapping[str, Tensor], out: Tensor) -> None:
        dequantize_mxfp4(tensors["weight_packed"], tensors["weight_scale"], out)

    def fused_codes(self) -> FusedCodes:
        return FusedCodes("mxfp4", MXFP4_GROUP_SIZE, "weight_packed", "weight_scale")


@dataclass(frozen=True)
class CompressedTensorsNvfp4Format(Format):
    """compressed-tensors ``nvfp4-pack-quantized``; ``weight_global_scale`` is a divisor."""

    name = "nvfp4-ct"
    roles = ("weight_packed", "weight_scale", "weight_global_scale")
    activation_roles = ("input_global_scale",)  # the NVFP4 (W4A4) scheme's static activation global scale

    def dequantized_shape(self, tensors: Mapping[str, Tensor]) -> tuple[int, ...]:
        return nvfp4_output_shape(tensors["weight_packed"], tensors["weight_scale"])

    def stored_shapes(
        self, shape: tuple[int, ...], dense_code: str
    ) -> dict[str, tuple[str, tuple[int, ...]]]:
        return _fp4_shapes(self.roles, shape, ("F8_E4M3", NVFP4_GROUP_SIZE), (1,))

    def dequantize(self, tensors: Mapping[str, Tensor], out: Tensor) -> None:
        dequantize_nvfp4_ct(
            tensors["weight_packed"], tensors["weight_scale"], tensors["weight_global_scale"], out
        )

    def fused_codes(self) -> FusedCodes:
        return FusedCodes("nvfp4-ct", NVFP4_GROUP_SIZE, "weight_packed", "weight_scale", "weight_global_scale")


@dataclass(frozen=True)
class CompressedTensorsInt4Format(Format):
    """compressed-tensors ``pack-quantized`` int4, symmetric, one ``weight_scale`` per ``group_size`` inputs
    (Kimi-K2-Thinking's W4A16 experts): ``weight_packed`` int32 ``[out, in/8]``, ``weight_shape`` ``[2]``."""

    name = "int4-ct"
    roles = ("weight_packed", "weight_scale", "weight_shape")
    group_size: int = INT4_DEFAULT_GROUP_SIZE

    def dequantized_shape(self, tensors: Mapping[str, Tensor]) -> tuple[int, ...]:
        shape = int4_output_shape(tensors["weight_packed"], tensors["weight_scale"], self.group_size)
        if tuple(tensors["weight_shape"].shape) != (len(shape),):
            raise CheckpointError(
                f"int4 pack-quantized weight_shape must hold {len(shape)} values, got shape "
                f"{tuple(tensors['weight_shape'].shape)}"
            )
        return shape

    def stored_shapes(
        self, shape: tuple[int, ...], dense_code: str
    ) -> dict[str, tuple[str, tuple[int, ...]]]:
        *rows, cols = shape
        return {
            "weight_packed": ("I32", (*rows, cols // INT4_PER_WORD)),
            "weight_scale": (dense_code, (*rows, cols // self.group_size)),  # the dtype the producer's model had
            "weight_shape": ("I64", (len(shape),)),
        }

    def dequantize(self, tensors: Mapping[str, Tensor], out: Tensor) -> None:
        dequantize_int4_packed(tensors["weight_packed"], tensors["weight_scale"], out, self.group_size)

    def fused_codes(self) -> FusedCodes:
        # bf16 scales: (code - 8) * scale is then exact in fp32 before the one cast (fp16 ones are multiplied in fp16)
        return FusedCodes("int4", self.group_size, "weight_packed", "weight_scale", scale_dtype=torch.bfloat16)


@dataclass(frozen=True)
class ModelOptNvfp4Format(Format):
    """NVIDIA ModelOpt NVFP4: ``weight`` (packed uint8), ``weight_scale``; ``weight_scale_2`` is a multiplier."""

    name = "nvfp4-modelopt"
    roles = ("weight", "weight_scale", "weight_scale_2")
    activation_roles = ("input_scale",)  # NVFP4 (W4A4): the activations' per-tensor scale; W4A16_NVFP4 has none

    def dequantized_shape(self, tensors: Mapping[str, Tensor]) -> tuple[int, ...]:
        return nvfp4_output_shape(tensors["weight"], tensors["weight_scale"])

    def stored_shapes(
        self, shape: tuple[int, ...], dense_code: str
    ) -> dict[str, tuple[str, tuple[int, ...]]]:
        return _fp4_shapes(self.roles, shape, ("F8_E4M3", NVFP4_GROUP_SIZE), ())

    def dequantize(self, tensors: Mapping[str, Tensor], out: Tensor) -> None:
        dequantize_nvfp4_modelopt(tensors["weight"], tensors["weight_scale"], tensors["weight_scale_2"], out)

    def fused_codes(self) -> FusedCodes:
        return FusedCodes("nvfp4-mo", NVFP4_GROUP_SIZE, "weight", "weight_scale", "weight_scale_2")


@dataclass(frozen=True)
class Fp8BlockFormat(Format):
    """FP8-E4M3 ``weight`` with a ``weight_scale_inv`` multiplier per ``block_size`` block."""

    name = "fp8-block"
    roles = ("weight", "weight_scale_inv")
    block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE  # (rows, columns) per scale

    def dequantized_shape(self, tensors: Mapping[str, Tensor]) -> tuple[int, ...]:
        weight, scale_inv = tensors["weight"], tensors["weight_scale_inv"]
        if weight.dim() != 2:
            raise CheckpointError(f"FP8 block weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
        expected = fp8_block_scale_shape((weight.shape[0], weight.shape[1]), self.block_size)
        if tuple(scale_inv.shape) != expected:
            raise CheckpointError(
                f"FP8 weight {tuple(weight.shape)} needs weight_scale_inv {expected}, got {tuple(scale_inv.shape)}"
            )
        return tuple(weight.shape)

    def stored_shapes(
        self, shape: tuple[int, ...], dense_code: str
    ) -> dict[str, tuple[str, tuple[int, ...]]]:
        rows, cols = shape
        return {
            "weight": ("F8_E4M3", shape),
            "weight_scale_inv": ("F32", fp8_block_scale_shape((rows, cols), self.block_size)),
        }

    def dequantize(self, tensors: Mapping[str, Tensor], out: Tensor) -> None:
        dequantize_fp8_block(tensors["weight"], tensors["weight_scale_inv"], out, self.block_size)


def e8m0_as_uint8(scale: Tensor) -> Tensor:
    """E8M0 scale bytes as uint8 (stored as float8_e8m0fnu or uint8): the byte is the biased exponent."""
    return scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale


@dataclass(frozen=True)
class Fp8BlockE8m0Format(Fp8BlockFormat):
    """DeepSeek-V4's FP8: FP8-E4M3 ``weight`` with a power-of-two ``scale`` (E8M0) multiplier per block."""

    name = "fp8-block-e8m0"
    roles = ("weight", "scale")

    def dequantized_shape(self, tensors: Mapping[str, Tensor]) -> tuple[int, ...]:
        return super().dequantized_shape({"weight": tensors["weight"], "weight_scale_inv": tensors["scale"]})

    def stored_shapes(self, shape: tuple[int, ...], dense_code: str) -> dict[str, tuple[str, tuple[int, ...]]]:
        return {"weight": ("F8_E4M3", shape), "scale": ("F8_E8M0", fp8_block_scale_shape(shape, self.block_size))}

    def dequantize(self, tensors: Mapping[str, Tensor], out: Tensor) -> None:
        exponents = e8m0_as_uint8(tensors["scale"]).to(torch.int32) - 127
        scale = torch.ldexp(torch.ones(exponents.shape, dtype=torch.float32), exponents)
        dequantize_fp8_block(tensors["weight"], scale, out, self.block_size)


@dataclass(frozen=True)
class DeepseekMxfp4Format(Format):
    """DeepSeek-V4's experts: MXFP4 ``weight`` (int8 ``[out, in/2]``, two E2M1 codes per byte, the low nibble
    first) and ``scale`` (E8M0 ``[out, in/32]``): the compressed-tensors MXFP4 layout under other names and dtypes."""

    name = "mxfp4-deepseek"
    roles = ("weight", "scale")

    def dequantized_shape(self, tensors: Mapping[str, Tensor]) -> tuple[int, ...]:
        return mxfp4_output_shape(tensors["weight"].view(torch.uint8), e8m0_as_uint8(tensors["scale"]))

    def stored_shapes(self, shape: tuple[int, ...], dense_code: str) -> dict[str, tuple[str, tuple[int, ...]]]:
        *rows, cols = shape
        return {"weight": ("I8", (*rows, cols // 2)), "scale": ("F8_E8M0", (*rows, cols // MXFP4_GROUP_SIZE))}

    def dequantize(self, tensors: Mapping[str, Tensor], out: Tensor) -> None:
        dequantize_mxfp4(tensors["weight"].view(torch.uint8), e8m0_as_uint8(tensors["scale"]), out)


@dataclass(frozen=True)
class Int8PerChannelFormat(Format):
    """Our on-load int8: ``weight`` int8 ``[out, in]`` + ``weight_scale`` float32 ``[out]`` (multiplier)."""

    name = "int8-per-channel"
    roles = ("weight", "weight_scale")

    def dequantized_shape(self, tensors: Mapping[str, Tensor]) -> tuple[int, ...]:
        return tuple(tensors["weight"].shape)

    def stored_shapes(
        self, shape: tuple[int, ...], dense_code: str
    ) -> dict[str, tuple[str, tuple[int, ...]]]:
        return {"weight": ("I8", shape), "weight_scale": ("F32", shape[:1])}

    def dequantize(self, tensors: Mapping[str, Tensor], out: Tensor) -> None:
        dequantize_int8_per_channel(tensors["weight"], tensors["weight_scale"], out)


# Format name -> class. Read-only: adding a format means adding a class above and listing it here.
_CLASSES: tuple[type[Format], ...] = (
    DenseFormat,
    GptOssMxfp4Format,
    CompressedTensorsMxfp4Format,
    CompressedTensorsNvfp4Format,
    CompressedTensorsInt4Format,
    ModelOptNvfp4Format,
    Fp8BlockFormat,
    Fp8BlockE8m0Format,
    DeepseekMxfp4Format,
    Int8PerChannelFormat,
    *GGUF_FORMATS.values(),
)
FORMATS: Mapping[str, type[Format]] = MappingProxyType({cls.name: cls for cls in _CLASSES})


def create_format(name: str, **options: Any) -> Format:
    """Return the `Format` registered as ``name``, built with ``options`` (e.g. ``block_size=(128, 128)``).

    Raises `UnsupportedModelError` for an unknown name, listing the known ones.
    """
    if name not in FORMATS:
        raise UnsupportedModelError(
            f"unknown weight format '{name}'; supported: {', '.join(sorted(FORMATS))}"
        )
    return FORMATS[name](**options)
