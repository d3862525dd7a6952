"""compressed-tensors ``pack-quantized`` INT4 (W4A16, symmetric, one scale per group along the input dim), the
format of Kimi-K2-Thinking's routed experts.

Layout (compressed-tensors 0.20.0 `PackedQuantizationCompressor` + `pack_to_int32` / `unpack_from_int32`):
- ``weight_packed`` int32 ``[out, in/8]``: element i of a row sits at bits ``4*(i % 8)`` of word ``i // 8``, so on a
  little-endian host the row's bytes hold two elements each, the LOW nibble the even one (the FP4 formats' order);
- each nibble is the code plus 8 (offset binary, ``pack_to_int32`` adds ``1 << (num_bits - 1)``), NOT two's
  complement: the value of nibble n is ``n - 8``, -8..7;
- ``weight_scale`` ``[out, in/group_size]`` in the model's dtype (bfloat16), a multiplier;
- ``weight_shape`` int64 ``[2]``, the dense ``(out, in)``: kept in the unit with the other stored bytes, never needed
  to decode (the shape comes from config.json and is checked against the packed tensors).
Dequant as compressed-tensors' ``dequantize`` does it: ``code.to(scale.dtype) * scale``, i.e. the float32 product
``(n - 8) * float32(scale)`` (exact: a 4-bit code times an 8-bit mantissa) rounded once into out's dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moeserve.errors import CheckpointError
from moeserve.formats.fp4 import dequantize_fp4_groups

INT4_VALUES: tuple[float, ...] = tuple(float(n - 8) for n in range(16))  # nibble n -> n - 8 (offset binary)
INT4_PER_WORD = 8  # 4-bit codes per int32 word of weight_packed
INT4_DEFAULT_GROUP_SIZE = 32  # Kimi-K2-Thinking's group size


def int4_output_shape(packed: Tensor, scale: Tensor, group_size: int) -> tuple[int, ...]:
    """Return the dense ``(..., out, in)`` of ``weight_packed`` ``[..., out, in/8]`` and ``weight_scale``."""
    if packed.dtype != torch.int32:
        raise CheckpointError(f"int4 pack-quantized weight_packed must be int32, got {packed.dtype}")
    if not scale.is_floating_point():
        raise CheckpointError(f"int4 pack-quantized weight_scale must be a float tensor, got {scale.dtype}")
    columns = packed.shape[-1] * INT4_PER_WORD if packed.dim() else 0
    if (
        packed.dim() < 2
        or packed.shape[:-1] != scale.shape[:-1]
        or scale.dim() != packed.dim()
        or scale.shape[-1] * group_size != columns
    ):
        raise CheckpointError(
            f"int4 pack-quantized weight_packed {tuple(packed.shape)} does not match weight_scale "
            f"{tuple(scale.shape)}: expected [..., out, in/8] and [..., out, in/{group_size}]"
        )
    return (*packed.shape[:-1], columns)


def dequantize_int4_packed(packed: Tensor, scale: Tensor, out: Tensor, group_size: int) -> None:
    """Write the int4 weight ``(nibble - 8) * scale[group]`` into ``out`` (contiguous, any float dtype).

    ``packed`` int32 ``[..., out, in/8]`` (contiguous), ``scale`` ``[..., out, in/group_size]``. Each element is the
    float32 product cast once into out.dtype, bit-exact with compressed-tensors' decompressor in the scale's dtype.
    Temporaries: `dequantize_fp4_groups`' bounded buffers. The bytes are read in the host's order: little-endian,
    as every platform torch runs moeserve on.
    """
    expected = int4_output_shape(packed, scale, group_size)
    if tuple(out.shape) != expected:
        raise ValueError(f"out has shape {tuple(out.shape)}, int4 pack-quantized data needs {expected}")
    scale_flat = scale.reshape(-1)  # [groups] in output order

    def write_scales(first: int, count: int, scales_out: Tensor) -> None:
        scales_out.copy_(scale_flat[first : first + count])  # bf16 / fp16 -> float32 is exact

    dequantize_fp4_groups(packed.contiguous().view(torch.uint8), out, group_size, write_scales, nibbles=INT4_VALUES)


INT4_QMIN, INT4_QMAX = -8, 7
INT4_SCALE_STEPS = 7.5  # amax / 7.5: compressed-tensors' symmetric int4 scale (half its 15 steps)


def quantize_int4_packed(weight: Tensor, group_size: int = INT4_DEFAULT_GROUP_SIZE) -> tuple[Tensor, Tensor]:
    """Quantize ``weight`` ``[out, in]`` to this module's layout: ``(weight_packed int32 [out, in/8], weight_scale
    bfloat16 [out, in/group_size])`` (quantization="int4": moeserve's on-load int4, read back by
    `dequantize_int4_packed` and the C++ 4-bit expert op like any compressed-tensors W4A16 checkpoint).

    Symmetric per group, computed as compressed-tensors' quantizer computes it on a bf16 weight (its
    ``calculate_qparams`` and ``quantize``, every step a bf16 op): ``scale = amax / 7.5``, codes
    ``clamp(round(w / scale), -8, 7)``, nibble ``code + 8``: the bytes compressed-tensors writes for the same bf16
    weight (tests/formats/test_int4_quantize.py). A weight of another dtype is rounded to bf16 first; an all-zero
    group (scale 0, where compressed-tensors would divide by zero) gets scale 1.0 and codes 0.
    """
    if weight.dim() != 2 or not weight.is_floating_point() or weight.shape[1] % group_size or group_size % 8:
        raise ValueError(f"int4 quantization needs a 2-D float weight whose columns split into groups of "
                         f"{group_size}, got {weight.dtype} {tuple(weight.shape)}")
    rows, cols = weight.shape
    groups = weight.to(torch.bfloat16).reshape(rows, cols // group_size, group_size)
    scale = groups.abs().amax(dim=2) / torch.tensor(INT4_SCALE_STEPS, dtype=torch.bfloat16)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(groups / scale[..., None]).clamp_(INT4_QMIN, INT4_QMAX)
    nibbles = (codes.reshape(rows, cols).to(torch.int16) - INT4_QMIN).to(torch.uint8)
    packed = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)  # [rows, cols/2]: element 2j in the low nibble of byte j
    return packed.contiguous().view(torch.int32), scale
