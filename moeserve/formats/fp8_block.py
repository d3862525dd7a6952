"""FP8-E4M3 weights with one scale per (128 x 128) block (DeepSeek-V3, Qwen3-FP8 checkpoints).

Layout: ``weight`` float8_e4m3fn ``[out, in]`` and ``weight_scale_inv`` float32 or bfloat16
``[ceil(out/bo), ceil(in/bi)]`` for block size ``(bo, bi)`` (normally 128 x 128). Edge blocks are partial;
nothing is padded on disk. Despite its name the scale is the dequantization MULTIPLIER:
``W[i, j] = float32(fp8[i, j]) * float32(scale[i // bo, j // bi])``, computed in float32, cast to out's dtype.
The block size comes from the config, never from ``out / scale_rows`` (that guess is wrong for edge blocks).
"""

from __future__ import annotations

import torch
from torch import Tensor

from moeserve.errors import CheckpointError

DEFAULT_BLOCK_SIZE = (128, 128)  # (rows, columns) of weight per scale


def fp8_block_scale_shape(weight_shape: tuple[int, ...], block_size: tuple[int, int]) -> tuple[int, int]:
    """Return the scale grid ``(ceil(out / bo), ceil(in / bi))`` for a ``[out, in]`` weight."""
    rows, cols = weight_shape
    block_rows, block_cols = block_size
    return (-(-rows // block_rows), -(-cols // block_cols))


def dequantize_fp8_block(
    weight: Tensor, scale_inv: Tensor, out: Tensor, block_size: tuple[int, int] = DEFAULT_BLOCK_SIZE
) -> None:
    """Write ``weight * scale_inv`` (per block) into ``out`` ``[out, in]`` of any float dtype, in place.

    ``weight`` is float8_e4m3fn ``[out, in]``; ``scale_inv`` float32 or bfloat16 with shape
    `fp8_block_scale_shape`. The fp8 values are copied into ``out`` (exact in bf16/fp16/fp32), then each block
    is multiplied in float32 and cast back. Temporary: a float32 copy of the scale grid (tiny).
    """
    _check_layout(weight, scale_inv, block_size)
    if out.shape != weight.shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, FP8 weight needs {tuple(weight.shape)}")
    block_rows, block_cols = block_size
    scales = scale_inv.to(dtype=torch.float32, device=out.device)  # [row_blocks, col_blocks]
    col_count = weight.shape[1]
    full_col_blocks = col_count // block_cols
    full_cols = full_col_blocks * block_cols
    out.copy_(weight)
    for row_block in range(scales.shape[0]):
        rows = out[row_block * block_rows : (row_block + 1) * block_rows]  # [<=bo, in]
        if full_col_blocks:
            # [<=bo, full_col_blocks, bi] * [1, full_col_blocks, 1]: mul_ by float32 computes in float32.
            full = rows[:, :full_cols].unflatten(1, (full_col_blocks, block_cols))
            full.mul_(scales[row_block, :full_col_blocks, None])
        if full_cols < col_count:
            rows[:, full_cols:].mul_(scales[row_block, full_col_blocks])  # the partial edge block


def _check_layout(weight: Tensor, scale_inv: Tensor, block_size: tuple[int, int]) -> None:
    if weight.dtype != torch.float8_e4m3fn:
        raise CheckpointError(f"FP8 block weight must be float8_e4m3fn, got {weight.dtype}")
    if not scale_inv.is_floating_point():
        raise CheckpointError(f"FP8 weight_scale_inv must be float32 or bfloat16, got {scale_inv.dtype}")
    if weight.dim() != 2:
        raise CheckpointError(f"FP8 block weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
    expected = fp8_block_scale_shape((weight.shape[0], weight.shape[1]), block_size)
    if tuple(scale_inv.shape) != expected:
        raise CheckpointError(
            f"FP8 weight {tuple(weight.shape)} with {block_size[0]}x{block_size[1]} blocks needs "
            f"weight_scale_inv {expected}, got {tuple(scale_inv.shape)}"
        )
