"""Packers that WRITE quantized weights, for tests and benchmarks (the engine only reads).

transformers cannot quantize MXFP4 on CPU, so `quantize_mxfp4` is our own; `quantize_fp8_block` mirrors the
DeepSeek-V3 layout. Both round to nearest; they aim for valid, realistic bytes, not for the best accuracy.
NVFP4 test bytes come from compressed-tensors' own compressor instead, so the reader is checked against an
independent writer.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moeserve.formats.fp8_block import DEFAULT_BLOCK_SIZE, fp8_block_scale_shape
from moeserve.formats.mxfp4 import E8M0_BIAS, MXFP4_GROUP_SIZE

# Midpoints between neighbouring E2M1 magnitudes (0, .5, 1, 1.5, 2, 3, 4, 6); a tie goes to the smaller one.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_EMAX = 2  # exponent of the largest E2M1 value (6 = 1.5 * 2**2)
_FP8_E4M3_MAX = 448.0
_GROUPS_PER_CHUNK = 1 << 16  # bounds the packer's temporaries to a few MiB


def quantize_mxfp4(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Quantize ``weight`` ``[..., R, C]`` (C a multiple of 32) to the gpt-oss HF MXFP4 layout.

    Returns ``(blocks uint8 [..., R, C/32, 16], scales uint8 [..., R, C/32])``. The shared exponent follows
    OCP MX: ``floor(log2(block_amax)) - 2``, so values above 6 * 2**e saturate to +-6. An all-zero block gets
    scale byte 127.
    """
    *lead, rows, cols = weight.shape
    if cols % MXFP4_GROUP_SIZE:
        raise ValueError(f"MXFP4 needs the last dim to be a multiple of {MXFP4_GROUP_SIZE}, got {cols}")
    groups = weight.detach().reshape(-1, MXFP4_GROUP_SIZE)  # [groups, 32]
    blocks = torch.empty(groups.shape[0], MXFP4_GROUP_SIZE // 2, dtype=torch.uint8)
    scales = torch.empty(groups.shape[0], dtype=torch.uint8)
    midpoints = torch.tensor(_E2M1_MIDPOINTS)
    for first in range(0, groups.shape[0], _GROUPS_PER_CHUNK):
        chunk = groups[first : first + _GROUPS_PER_CHUNK].to(torch.float32)
        amax = chunk.abs().amax(dim=1)
        _, amax_exp = torch.frexp(amax)  # amax = m * 2**amax_exp, m in [0.5, 1)
        shared_exp = torch.where(amax > 0, amax_exp - 1 - _E2M1_EMAX, torch.zeros_like(amax_exp))
        biased = (shared_exp + E8M0_BIAS).clamp(0, 254)  # 255 is NaN in OCP MX
        scaled = chunk / torch.ldexp(torch.ones_like(amax), biased - E8M0_BIAS)[:, None]
        codes = _round_to_e2m1_codes(scaled, midpoints)  # [n, 32] uint8
        blocks[first : first + chunk.shape[0]] = codes[:, 0::2] | (codes[:, 1::2] << 4)
        scales[first : first + chunk.shape[0]] = biased.to(torch.uint8)
    group_count = cols // MXFP4_GROUP_SIZE
    return blocks.view(*lead, rows, group_count, MXFP4_GROUP_SIZE // 2), scales.view(*lead, rows, group_count)


def quantize_fp8_block(
    weight: Tensor,
    block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE,
    scale_dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor]:
    """Quantize ``weight`` ``[out, in]`` to ``(float8_e4m3fn [out, in], weight_scale_inv [ceil, ceil])``.

    Each block's scale is ``block_amax / 448`` (1.0 for an all-zero block), rounded to ``scale_dtype`` before
    the codes are computed, so the stored scale is the one the codes were made with. Edge blocks are partial.
    """
    if weight.dim() != 2:
        raise ValueError(f"FP8 block quantization needs a 2-D weight, got shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    block_rows, block_cols = block_size
    grid_rows, grid_cols = fp8_block_scale_shape((rows, cols), block_size)
    weight_f32 = weight.detach().to(torch.float32)
    # Pad to whole blocks with zeros only to take the block amax; the padding never reaches the output.
    padded = weight_f32.new_zeros(grid_rows * block_rows, grid_cols * block_cols)
    padded[:rows, :cols] = weight_f32
    block_amax = padded.view(grid_rows, block_rows, grid_cols, block_cols).abs().amax(dim=(1, 3))
    scale = torch.where(block_amax > 0, block_amax / _FP8_E4M3_MAX, torch.ones_like(block_amax))
    scale = scale.to(scale_dtype)
    per_element = scale.to(torch.float32).repeat_interleave(block_rows, 0)[:rows]
    per_element = per_element.repeat_interleave(block_cols, 1)[:, :cols]
    codes = (weight_f32 / per_element).clamp_(-_FP8_E4M3_MAX, _FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return codes, scale


def _round_to_e2m1_codes(values: Tensor, midpoints: Tensor) -> Tensor:
    # Magnitude code = number of midpoints strictly below |x| (|x| above 5 saturates to code 7 = 6.0).
    magnitude = torch.bucketize(values.abs(), midpoints, right=False).to(torch.uint8)
    sign = torch.signbit(values).to(torch.uint8) << 3
    return magnitude | sign
