"""ggml's tensor types and the exact torch dequantizers of those moeserve reads.

Every decoder computes what the `gguf` package's reference ``gguf.quants.dequantize`` computes, in the same float32
operations in the same order (one rounding per numpy operation: ``d * q - dm`` is a product then a difference, never
a fused multiply-add), so the result is equal bit for bit (tests/checkpoint/test_gguf_quants.py, on random blocks and
on blocks the gguf package's quantizer writes). Input: the stored bytes, uint8 ``[..., row_bytes]``; output: float32
``[..., row_values]``.

Block layouts (ggml-common.h), per block of `block_elems` values:
- Q8_0 (34 B / 32): f16 d, 32 int8 q; x = q * d.
- Q4_0 (18 B / 32): f16 d, 16 bytes; value j < 16 is the low nibble of byte j, value 16 + j its high nibble; x = (q - 8) * d.
- Q4_K (144 B / 256): f16 d, f16 dmin, 12 bytes of eight 6-bit scales and mins, 128 bytes of nibbles; sub-block
  s = 2g + h (32 values) is nibble h of bytes [32g, 32g + 32); x = (d * sc[s]) * q - dmin * m[s].
- Q5_K (176 B / 256): as Q4_K, plus 32 bytes of fifth bits (bit s of byte i is value i of sub-block s) before the nibbles.
- Q6_K (210 B / 256): 128 bytes of low nibbles, 64 of two high bits, 16 int8 scales, f16 d; x = (d * sc[s]) * (q - 32)
  for sixteen sub-blocks of 16.
- MXFP4 (17 B / 32): one E8M0 exponent byte e, 16 bytes of E2M1 codes (low nibbles values 0-15, high 16-31);
  x = 2^(e - 128) * (2 * E2M1[q]) (ggml's "half" scale times the doubled code table).
- F32, F16, BF16: plain values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

QK_K = 256


@dataclass(frozen=True)
class GGMLType:
    """One ggml tensor type: its id in a GGUF header, name, values per block and bytes per block."""

    type_id: int
    name: str
    block_elems: int
    block_bytes: int

    def row_bytes(self, values: int) -> int:
        return values // self.block_elems * self.block_bytes

    @property
    def is_float(self) -> bool:
        return self.name in ("F32", "F16", "BF16")


# Every type of ggml.h (ids and block sizes as gguf.constants.GGML_QUANT_SIZES), so any file's header is validated;
# `DEQUANTIZERS` says which are read.
GGML_TYPES: dict[int, GGMLType] = {t.type_id: t for t in (
    GGMLType(0, "F32", 1, 4), GGMLType(1, "F16", 1, 2), GGMLType(2, "Q4_0", 32, 18), GGMLType(3, "Q4_1", 32, 20),
    GGMLType(6, "Q5_0", 32, 22), GGMLType(7, "Q5_1", 32, 24), GGMLType(8, "Q8_0", 32, 34), GGMLType(9, "Q8_1", 32, 36),
    GGMLType(10, "Q2_K", 256, 84), GGMLType(11, "Q3_K", 256, 110), GGMLType(12, "Q4_K", 256, 144),
    GGMLType(13, "Q5_K", 256, 176), GGMLType(14, "Q6_K", 256, 210), GGMLType(15, "Q8_K", 256, 292),
    GGMLType(16, "IQ2_XXS", 256, 66), GGMLType(17, "IQ2_XS", 256, 74), GGMLType(18, "IQ3_XXS", 256, 98),
    GGMLType(19, "IQ1_S", 256, 50), GGMLType(20, "IQ4_NL", 32, 18), GGMLType(21, "IQ3_S", 256, 110),
    GGMLType(22, "IQ2_S", 256, 82), GGMLType(23, "IQ4_XS", 256, 136), GGMLType(24, "I8", 1, 1),
    GGMLType(25, "I16", 1, 2), GGMLType(26, "I32", 1, 4), GGMLType(27, "I64", 1, 8), GGMLType(28, "F64", 1, 8),
    GGMLType(29, "IQ1_M", 256, 56), GGMLType(30, "BF16", 1, 2), GGMLType(34, "TQ1_0", 256, 54),
    GGMLType(35, "TQ2_0", 256, 66), GGMLType(39, "MXFP4", 32, 17), GGMLType(40, "NVFP4", 64, 36),
)}
TYPES_BY_NAME: dict[str, GGMLType] = {t.name: t for t in GGML_TYPES.values()}

# The doubled E2M1 values ggml decodes MXFP4 with (kvalues_mxfp4)
_MXFP4_DOUBLED = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.float32)


def _f16(b: Tensor) -> Tensor:
    """[n, 2] little-endian f16 bytes -> [n, 1] float32."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: Tensor, shifts: tuple[int, ...], mask: int) -> Tensor:
    """[n, g, w] bytes -> [n, g, len(shifts), w]: (byte >> shift) & mask per shift (int32)."""
    s = torch.tensor(shifts, dtype=torch.int32).view(1, 1, -1, 1)
    return (qs.to(torch.int32).unsqueeze(2) >> s) & mask


def _q8_0(blocks: Tensor) -> Tensor:
    return blocks[:, 2:].contiguous().view(torch.int8).float() * _f16(blocks[:, :2])


def _q4_0(blocks: Tensor) -> Tensor:
    q = _nibbles(blocks[:, 2:].reshape(-1, 1, 16), (0, 4), 0x0F).reshape(-1, 32) - 8
    return _f16(blocks[:, :2]) * q.float()


def _k_scales(scales: Tensor) -> tuple[Tensor, Tensor]:
    """Q4_K / Q5_K: twelve bytes -> eight 6-bit scales and eight 6-bit mins, [n, 8] int32 each."""
    s = scales.to(torch.int32).reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_affine(blocks: Tensor, q: Tensor) -> Tensor:
    """(d * sc) * q - dmin * m per 32-value sub-block; q [n, 8, 32] int32."""
    sc, mn = _k_scales(blocks[:, 4:16])
    d = (_f16(blocks[:, 0:2]) * sc.float()).unsqueeze(-1)
    dm = (_f16(blocks[:, 2:4]) * mn.float()).unsqueeze(-1)
    return (d * q.float() - dm).reshape(-1, QK_K)


def _q4_k(blocks: Tensor) -> Tensor:
    q = _nibbles(blocks[:, 16:].reshape(-1, 4, 32), (0, 4), 0x0F).reshape(-1, 8, 32)
    return _k_affine(blocks, q)


def _q5_k(blocks: Tensor) -> Tensor:
    low = _nibbles(blocks[:, 48:].reshape(-1, 4, 32), (0, 4), 0x0F).reshape(-1, 8, 32)
    high = _nibbles(blocks[:, 16:48].reshape(-1, 1, 32), tuple(range(8)), 0x01).reshape(-1, 8, 32)
    return _k_affine(blocks, low | (high << 4))


def _q6_k(blocks: Tensor) -> Tensor:
    low = _nibbles(blocks[:, :128].reshape(-1, 2, 64), (0, 4), 0x0F).reshape(-1, 8, 32)
    high = _nibbles(blocks[:, 128:192].reshape(-1, 2, 32), (0, 2, 4, 6), 0x03).reshape(-1, 8, 32)
    q = ((low | (high << 4)) - 32).reshape(-1, 16, 16)
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(blocks[:, 208:210]) * scales).unsqueeze(-1)
    return (d * q.float()).reshape(-1, QK_K)


def _mxfp4(blocks: Tensor) -> Tensor:
    e = blocks[:, :1].to(torch.int32)
    bits = torch.where(e < 2, torch.tensor(0x00200000, dtype=torch.int32) << e, (e - 1) << 23)
    q = _nibbles(blocks[:, 1:].reshape(-1, 1, 16), (0, 4), 0x0F).reshape(-1, 32)
    return bits.view(torch.float32) * _MXFP4_DOUBLED[q]


def _bf16(blocks: Tensor) -> Tensor:
    return (blocks.contiguous().view(torch.int16).to(torch.int32) << 16).view(torch.float32)


def _f16_values(blocks: Tensor) -> Tensor:
    return blocks.contiguous().view(torch.float16).float()


def _f32_values(blocks: Tensor) -> Tensor:
    return blocks.contiguous().view(torch.float32).clone()


# ggml type name -> decoder of [n_blocks, block_bytes] uint8 -> [n_blocks, block_elems] float32
DEQUANTIZERS: dict[str, Callable[[Tensor], Tensor]] = {
    "F32": _f32_values, "F16": _f16_values, "BF16": _bf16, "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_K": _q4_k,
    "Q5_K": _q5_k, "Q6_K": _q6_k, "MXFP4": _mxfp4,
}


def is_readable(gtype: GGMLType) -> bool:
    return gtype.name in DEQUANTIZERS


def dequantize(stored: Tensor, gtype: GGMLType) -> Tensor:
    """float32 values of `stored` (uint8 [..., row_bytes] of `gtype`, or the raw float tensor) -> [..., row_values]."""
    raw = stored.contiguous().view(torch.uint8).reshape(-1)
    row_bytes = stored.shape[-1] * stored.element_size()
    lead = tuple(stored.shape[:-1])
    values = DEQUANTIZERS[gtype.name](raw.reshape(-1, gtype.block_bytes))
    return values.reshape(*lead, row_bytes // gtype.block_bytes * gtype.block_elems)
