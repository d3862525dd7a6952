"""NVFP4 dequantization: E2M1 codes, one FP8-E4M3 scale per 16 input elements, one float32 tensor scale.

Layout (both conventions hold identical bytes): packed codes uint8 ``[out, in/2]`` (low nibble = even
element), group scales float8_e4m3fn ``[out, in/16]`` (linear row-major, not swizzled), one float32 scalar.
The two conventions differ only in what the scalar means:
- compressed-tensors (``weight_packed``, ``weight_scale``, ``weight_global_scale``): the scalar is a DIVISOR,
  ``W = code * (float32(fp8_scale) / weight_global_scale)``;
- NVIDIA ModelOpt (``weight``, ``weight_scale``, ``weight_scale_2``): the scalar is a MULTIPLIER,
  ``W = code * (float32(fp8_scale) * weight_scale_2)``.
Each is computed in float32 and then cast to out's dtype, exactly as compressed-tensors' decompressor and
torchao's ``NVFP4Tensor.dequantize`` do. Fused shards (q/k/v, gate/up) each keep their own scalar: dequantize
each shard with its own, never with a max across shards.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moeserve.errors import CheckpointError
from moeserve.formats.fp4 import dequantize_fp4_groups

NVFP4_GROUP_SIZE = 16  # elements per FP8 group scale


def nvfp4_output_shape(packed: Tensor, group_scales: Tensor) -> tuple[int, ...]:
    """Return the dequantized shape ``(..., out, in)`` of packed ``[..., out, in/2]`` codes."""
    _check_layout(packed, group_scales)
    return (*packed.shape[:-1], packed.shape[-1] * 2)


def dequantize_nvfp4_ct(
    weight_packed: Tensor, weight_scale: Tensor, weight_global_scale: Tensor, out: Tensor
) -> None:
    """Write a compressed-tensors NVFP4 weight into ``out``: ``code * (fp8_scale / weight_global_scale)``.

    ``weight_global_scale`` is a one-element float32 tensor (``448 * 6 / amax``), a divisor. ``out`` must be
    contiguous with shape `nvfp4_output_shape`. Temporaries: see `dequantize_fp4_groups` (bounded, reused).
    """
    _dequantize_nvfp4(weight_packed, weight_scale, weight_global_scale, out, global_is_divisor=True)


def dequantize_nvfp4_modelopt(
    weight: Tensor, weight_scale: Tensor, weight_scale_2: Tensor, out: Tensor
) -> None:
    """Write a ModelOpt NVFP4 weight into ``out``: ``code * (fp8_scale * weight_scale_2)``.

    ``weight_scale_2`` is a one-element float32 tensor (``amax / (448 * 6)``), a multiplier: the reciprocal of
    compressed-tensors' ``weight_global_scale``. Otherwise as `dequantize_nvfp4_ct`.
    """
    _dequantize_nvfp4(weight, weight_scale, weight_scale_2, out, global_is_divisor=False)


def _dequantize_nvfp4(
    packed: Tensor, group_scales: Tensor, tensor_scale: Tensor, out: Tensor, *, global_is_divisor: bool
) -> None:
    expected = nvfp4_output_shape(packed, group_scales)
    if tuple(out.shape) != expected:
        raise ValueError(f"out has shape {tuple(out.shape)}, NVFP4 data needs {expected}")
    if tensor_scale.numel() != 1:
        raise CheckpointError(
            f"NVFP4 tensor scale must hold one value, got shape {tuple(tensor_scale.shape)}"
        )
    # A 0-dim float32 tensor, like the references' [1] tensor: the op runs in float32, not float64.
    scalar = tensor_scale.reshape(()).to(dtype=torch.float32, device=out.device)
    scale_flat = group_scales.reshape(-1)  # [groups] in output order

    def write_scales(first: int, count: int, scales_out: Tensor) -> None:
        scales_out.copy_(scale_flat[first : first + count])  # fp8 -> float32 is exact
        if global_is_divisor:
            scales_out.div_(scalar)
        else:
            scales_out.mul_(scalar)

    dequantize_fp4_groups(packed, out, NVFP4_GROUP_SIZE, write_scales)


def _check_layout(packed: Tensor, group_scales: Tensor) -> None:
    if packed.dtype != torch.uint8:
        raise CheckpointError(f"NVFP4 packed weight must be uint8, got {packed.dtype}")
    if not group_scales.is_floating_point():
        raise CheckpointError(f"NVFP4 group scales must be float8_e4m3fn, got {group_scales.dtype}")
    half_group = NVFP4_GROUP_SIZE // 2  # packed bytes per group
    if (
        packed.dim() < 1
        or packed.dim() != group_scales.dim()
        or packed.shape[:-1] != group_scales.shape[:-1]
        or packed.shape[-1] != group_scales.shape[-1] * half_group
    ):
        raise CheckpointError(
            f"NVFP4 packed weight {tuple(packed.shape)} does not match group scales {tuple(group_scales.shape)}: "
            f"expected [..., out, in/2] and [..., out, in/16]"
        )
