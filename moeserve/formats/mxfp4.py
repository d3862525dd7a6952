"""MXFP4 (OCP microscaling FP4) dequantization: E2M1 codes, one E8M0 scale per 32 input elements.

Two on-disk layouts hold the same bytes:
- gpt-oss HF: ``*_blocks`` uint8 ``[..., R, G, 16]`` and ``*_scales`` uint8 ``[..., R, G]``;
- compressed-tensors ``mxfp4-pack-quantized``: ``weight_packed`` ``[out, in/2]``, ``weight_scale`` ``[out, in/32]``.
Row r holds output feature r; the 32 elements of a block run along the input dim. Output is row-major
``[..., R, G*32]`` (out features x in features). Value = ``ldexp(E2M1[nibble], scale - 127)``, the exact
product rounded once. OCP reserves scale byte 255 for NaN; like transformers and the gpt-oss reference we
decode it as the plain product (so 0.5 * 2**128 = 2**127 is finite, 1 * 2**128 is inf).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
from torch import Tensor

from moeserve.errors import CheckpointError
from moeserve.formats.fp4 import dequantize_fp4_groups

MXFP4_GROUP_SIZE = 32  # elements per E8M0 scale
E8M0_BIAS = 127


# The codes are decoded times 2 and the scales halved: then scale byte 255 gives the float32 2**127 rather
# than an overflowed 2**128, and (2 * code) * 2**(s - 128) is still the exact product for every byte.
CODE_SCALE = 2.0


@lru_cache(maxsize=8)
def e8m0_half_table(device: torch.device) -> Tensor:
    """Return ``2**(s - 128)`` in float32 for every E8M0 byte ``s``, ``[256]`` (half the scale's value).

    Exact for all 256 bytes (2**-128 is a float32 subnormal). Cached per device; callers must not write into it.
    """
    values = [math.ldexp(1.0, s - E8M0_BIAS - 1) for s in range(256)]
    return torch.tensor(values, dtype=torch.float64).to(dtype=torch.float32, device=device)


def mxfp4_output_shape(blocks: Tensor, scales: Tensor) -> tuple[int, ...]:
    """Return the dequantized shape ``(..., R, G*32)`` for either MXFP4 layout (see module docstring)."""
    _check_layout(blocks, scales)
    return (*scales.shape[:-1], scales.shape[-1] * MXFP4_GROUP_SIZE)


def dequantize_mxfp4(blocks: Tensor, scales: Tensor, out: Tensor) -> None:
    """Write the MXFP4 weight held by ``blocks``/``scales`` into ``out`` (any float dtype), in place.

    Layouts: gpt-oss ``[..., R, G, 16]`` + ``[..., R, G]`` or compressed-tensors ``[R, G*16]`` + ``[R, G]``.
    ``out`` must be contiguous with shape `mxfp4_output_shape`. Each element is rounded once into out.dtype
    (exact for bfloat16 and float32). Temporaries: `dequantize_fp4_groups`' index and scale buffers plus
    one int32 buffer for the scale bytes of a chunk (at most 32 KiB).
    """
    expected = mxfp4_output_shape(blocks, scales)
    if tuple(out.shape) != expected:
        raise ValueError(f"out has shape {tuple(out.shape)}, MXFP4 data needs {expected}")
    scale_bytes = scales.reshape(-1)  # [groups], uint8, in output order
    table = e8m0_half_table(out.device)
    scale_index = torch.empty(0, dtype=torch.int32, device=out.device)

    def write_scales(first: int, count: int, scales_out: Tensor) -> None:
        nonlocal scale_index
        if scale_index.numel() < count:
            scale_index = torch.empty(count, dtype=torch.int32, device=out.device)
        index = scale_index[:count]
        index.copy_(scale_bytes[first : first + count])
        torch.index_select(table, 0, index, out=scales_out)

    dequantize_fp4_groups(blocks, out, MXFP4_GROUP_SIZE, write_scales, code_scale=CODE_SCALE)


def _check_layout(blocks: Tensor, scales: Tensor) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise CheckpointError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    half_group = MXFP4_GROUP_SIZE // 2  # packed bytes per block
    gpt_oss = tuple(blocks.shape) == (*scales.shape, half_group)
    packed_rows = blocks.dim() >= 1 and tuple(blocks.shape) == (
        *scales.shape[:-1],
        scales.shape[-1] * half_group,
    )
    if scales.dim() == 0 or not (gpt_oss or packed_rows):
        raise CheckpointError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}: expected "
            f"blocks [..., R, G, 16] or [..., R, G*16] for scales [..., R, G]"
        )
