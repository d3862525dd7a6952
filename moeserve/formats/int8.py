"""Symmetric per-output-channel int8 weights, made on load from a 16/32-bit weight.

``q`` int8 ``[out, in]`` in [-127, 127] and ``scale`` float32 ``[out]`` with ``scale = amax(|row|) / 127``;
``W ~= float32(q) * scale[:, None]``, and |W - dequantized| <= scale / 2 per element before the final
rounding into out's dtype. An all-zero row gets scale 1.0 (its codes are all 0, so any scale is exact).
"""

from __future__ import annotations

import torch
from torch import Tensor

INT8_MAX = 127  # symmetric: -128 is never used, so negation is exact


def quantize_int8_per_channel(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Quantize ``weight`` ``[out, in]`` (float16/bfloat16/float32) to ``(q int8 [out, in], scale float32 [out])``.

    Rounds to nearest (ties to even). Allocates the two results plus float32 temporaries of the weight's size.
    """
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(
            f"int8 quantization needs a 2-D float weight, got {weight.dtype} {tuple(weight.shape)}"
        )
    weight_f32 = weight.to(torch.float32)
    row_amax = weight_f32.abs().amax(dim=1)  # [out]
    scale = torch.where(row_amax > 0, row_amax / INT8_MAX, torch.ones_like(row_amax))
    q = torch.round(weight_f32 / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_int8_per_channel(q: Tensor, scale: Tensor, out: Tensor) -> None:
    """Write ``float32(q) * scale[:, None]`` into ``out`` ``[out, in]`` (float32 product, cast to out's dtype).

    No temporary: the codes are copied into ``out`` (exact in any float dtype) and scaled in place.
    """
    if q.dtype != torch.int8 or q.dim() != 2:
        raise ValueError(f"int8 dequantization needs 2-D int8 codes, got {q.dtype} {tuple(q.shape)}")
    if tuple(scale.shape) != (q.shape[0],) or scale.dtype != torch.float32:
        raise ValueError(f"int8 scale must be float32 [{q.shape[0]}], got {scale.dtype} {tuple(scale.shape)}")
    if out.shape != q.shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, int8 codes need {tuple(q.shape)}")
    out.copy_(q)
    out.mul_(scale.to(out.device)[:, None])  # float32 multiply, then cast into out.dtype
