"""Dense Linears in the layout chosen once at load.

A Linear never changes layout after it is built; its `numerics` (C++ ops, batch invariance) are given at build too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeserve.formats.int8 import dequantize_int8_per_channel, quantize_int8_per_channel
from moeserve.memory.hugepages import on_huge_pages
from moeserve.models.numerics import Numerics


class Linear:
    """y = x W^T (+ b). W [out, in] in the compute dtype, kept in one of three layouts chosen once at load:

    - "interleaved" (the moeserve C++ kernels are on, bf16, CPU with AVX512-BF16, in % 32 == 0): rows in blocks
      of 4 with their 32-element chunks side by side, read by `torch.ops.moeserve.linear_interleaved` as one
      sequential stream per block (see csrc/dense_gemv.cpp). Measured at batch 1 on the bench machine: 20-30 GB/s
      against 13-20 GB/s for oneDNN's packed GEMV, and 5 us against 26 us for a router-sized [32, 1024] one. Each
      output is one fp32 dot product rounded once, whatever the batch size.
    - "onednn" (bf16 on a CPU where oneDNN computes bf16 natively, without the C++ kernels): reordered into
      oneDNN's blocked layout; ~1.6x the speed of F.linear on the plain layout, bit-identical to it (tests in
      tests/models/test_linear_packing.py).
    - "int8" (quantization="int8" with the C++ kernels on, bf16 compute, in % 32 == 0): per-output-row symmetric
      int8 codes (moeserve.formats.int8) in a layout like "interleaved" (pack_int8_rows) plus float32 scales, read by
      `torch.ops.moeserve.linear_interleaved_int8` (csrc/dense_gemv_int8.cpp): half the bytes of "interleaved";
      each output is one fp32 dot product of the exact codes with x, times the row scale, rounded once.
    - "plain": F.linear.

    `weight` gives a plain copy for inspection (dequantized for "int8"), never used on the hot path.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, numerics: Numerics = Numerics(),
                 int8: bool = False) -> None:
        self.out_features, self.in_features = weight.shape[0], weight.shape[-1]
        self.bias = bias
        self._scale: torch.Tensor | None = None
        cpp = numerics.cpp
        if cpp and int8 and can_quantize_int8(weight, bias):
            self.layout = "int8"
            codes, self._scale = quantize_int8_per_channel(weight)
            self._weight = on_huge_pages(pack_int8_rows(codes))
            self._dtype = weight.dtype
        elif cpp and _can_interleave(weight, bias):
            self.layout = "interleaved"
            self._weight = on_huge_pages(interleave_rows(weight))  # streamed every step: 2 MiB pages
        elif _can_pack(weight):
            self.layout = "onednn"
            self._weight = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        else:
            self.layout = "plain"
            self._weight = weight
        self.numerics = numerics  # batch-invariant: "onednn" / "plain" in fixed row blocks (Numerics.rows)

    @property
    def packed(self) -> bool:
        """True when the weight is in oneDNN's blocked layout."""
        return self.layout == "onednn"

    @property
    def weight(self) -> torch.Tensor:
        """W [out, in] as a plain tensor (a copy unless the layout is plain)."""
        if self.layout == "interleaved":
            return deinterleave_rows(self._weight, self.out_features, self.in_features)
        if self.layout == "int8":
            assert self._scale is not None
            out = torch.empty(self.out_features, self.in_features, dtype=self._dtype)
            dequantize_int8_per_channel(unpack_int8_rows(self._weight, self.out_features, self.in_features),
                                        self._scale, out)
            return out
        return self._weight.to_dense() if self.layout == "onednn" else self._weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout == "int8":
            return torch.ops.moeserve.linear_interleaved_int8(x, self._weight, self._scale, self.out_features,
                                                              self.bias)
        if self.layout == "interleaved":
            return torch.ops.moeserve.linear_interleaved(x, self._weight, self.out_features, self.bias)
        if x.dim() == 2:
            return self.numerics.rows(self._torch_linear, x)
        return self._torch_linear(x)

    def _torch_linear(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout == "onednn":
            x2 = x.reshape(-1, x.shape[-1])  # oneDNN's linear takes [rows, in]
            y = torch.ops.mkldnn._linear_pointwise(x2, self._weight, self.bias, "none", [], "")
            return y.view(*x.shape[:-1], y.shape[-1])
        return F.linear(x, self._weight, self.bias)

    @property
    def in_gemv_layout(self) -> bool:
        """Held in a layout of moeserve's C++ GEMV ("interleaved" or "int8"), which the decode stack reads."""
        return self.layout in ("interleaved", "int8")

    def gemv_tensors(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(packed weight, its int8 row scales or None) for the C++ GEMV (see in_gemv_layout)."""
        return self._weight, self._scale if self.layout == "int8" else None

    @property
    def nbytes(self) -> int:
        n = self._weight.numel() * self._weight.element_size()
        if self._scale is not None:
            n += self._scale.numel() * self._scale.element_size()
        return n + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())


def _can_pack(weight: torch.Tensor) -> bool:
    """A 2-D bf16 CPU weight, on a build and CPU where oneDNN computes bf16 natively."""
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
            and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _can_interleave(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """A 2-D bf16 CPU weight whose rows split into 32-element chunks, on a CPU the C++ GEMV runs on."""
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
            and weight.shape[1] % 32 == 0 and (bias is None or bias.dtype == torch.bfloat16)
            and bool(torch.ops.moeserve.gemv_bf16_supported()))


def can_quantize_int8(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """A 2-D bf16 CPU weight whose rows split into 32-element chunks: what the int8 GEMV takes (its AVX512-BF16
    path, or a portable one elsewhere)."""
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
            and weight.shape[1] % 32 == 0 and (bias is None or bias.dtype == torch.bfloat16))


def interleave_rows(w: torch.Tensor) -> torch.Tensor:
    """W [N, K] (K % 32 == 0) -> flat [N*K]: blocks of 4 rows with their 32-element chunks side by side
    (packed[((b * K/32 + c) * 4 + r) * 32 + i] = W[4b + r, 32c + i]), then the N % 4 leftover rows as they are."""
    n, k = w.shape
    n4 = n // 4 * 4
    blocks = w[:n4].reshape(n4 // 4, 4, k // 32, 32).permute(0, 2, 1, 3).reshape(-1)
    return torch.cat([blocks, w[n4:].reshape(-1)])


def pack_int8_rows(q: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] (K % 32 == 0, in [-127, 127]) -> flat int8 [N*K] in linear_interleaved_int8's layout
    (csrc/dense_gemv_int8.cpp): blocks of 4 rows, chunk c of a block = rows (0, 1) then (2, 3), each pair as 4 groups
    of [8 codes of its first row, 8 of its second], codes in sign-magnitude; then the N % 4 leftover rows as they
    are (two's complement)."""
    n, k = q.shape
    n4 = n // 4 * 4
    head = q[:n4]
    mag = head.abs().to(torch.uint8)
    sm = torch.where(head < 0, mag | 0x80, mag)
    blocks = sm.reshape(n4 // 4, 2, 2, k // 32, 4, 8).permute(0, 3, 1, 4, 2, 5).reshape(-1).view(torch.int8)
    return torch.cat([blocks, q[n4:].reshape(-1)])


def unpack_int8_rows(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The inverse of pack_int8_rows: int8 codes [N, K]."""
    n4 = n // 4 * 4
    sm = packed[: n4 * k].view(torch.uint8).reshape(n4 // 4, k // 32, 2, 4, 2, 8).permute(0, 2, 4, 1, 3, 5)
    mag = (sm & 0x7F).to(torch.int16).reshape(n4, k)
    head = torch.where(sm.reshape(n4, k) >= 0x80, -mag, mag).to(torch.int8)
    return torch.cat([head, packed[n4 * k :].reshape(n - n4, k)])


def deinterleave_rows(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The inverse of interleave_rows: W [N, K]."""
    n4 = n // 4 * 4
    blocks = packed[: n4 * k].reshape(n4 // 4, k // 32, 4, 32).permute(0, 2, 1, 3).reshape(n4, k)
    return torch.cat([blocks, packed[n4 * k :].reshape(n - n4, k)])

