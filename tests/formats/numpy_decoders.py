"""Independent numpy decoders used as test oracles: they work from the bit definitions of each format.

They share no code with moeserve.formats (no LUT, no torch casts of fp8) so a bug in one shows up as a diff.
"""

from __future__ import annotations

import numpy as np


def decode_e2m1(codes: np.ndarray) -> np.ndarray:
    """E2M1 code (0..15) -> float64 value: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0."""
    codes = codes.astype(np.int64)
    sign = np.where(codes & 0b1000, -1.0, 1.0)
    exponent = (codes >> 1) & 0b11
    mantissa = (codes & 0b1).astype(np.float64)
    normal = np.ldexp(1.0 + mantissa / 2.0, exponent - 1)
    subnormal = mantissa * 0.5
    return sign * np.where(exponent == 0, subnormal, normal)


def decode_e4m3fn(bits: np.ndarray) -> np.ndarray:
    """float8_e4m3fn byte -> float64: sign bit 7, exponent bits 6-3 (bias 7), mantissa bits 2-0; 0x7F/0xFF NaN."""
    bits = bits.astype(np.int64)
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exponent = (bits >> 3) & 0xF
    mantissa = (bits & 0x7).astype(np.float64)
    normal = np.ldexp(1.0 + mantissa / 8.0, exponent - 7)
    subnormal = np.ldexp(mantissa / 8.0, -6)
    value = sign * np.where(exponent == 0, subnormal, normal)
    return np.where((bits & 0x7F) == 0x7F, np.nan, value)


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """uint8 [..., n] -> codes [..., 2n]: element 2j is the low nibble of byte j, 2j+1 the high nibble."""
    low = packed & 0x0F
    high = packed >> 4
    return np.stack([low, high], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def mxfp4_float32(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """gpt-oss blocks [..., R, G, 16] + E8M0 scales [..., R, G] -> float32 [..., R, G*32] (exact product)."""
    values = decode_e2m1(unpack_nibbles(blocks))  # [..., R, G, 32]
    with np.errstate(over="ignore"):
        exact = np.ldexp(values, scales.astype(np.int64)[..., None] - 127)  # float64, exact
        product = exact.astype(np.float32)  # one rounding (overflow -> inf)
    return product.reshape(*scales.shape[:-1], scales.shape[-1] * 32)


def nvfp4_float32(
    packed: np.ndarray, scale_bits: np.ndarray, tensor_scale: float, divide: bool
) -> np.ndarray:
    """NVFP4 packed [out, in/2] + e4m3 bits [out, in/16] -> float32 [out, in], float32 arithmetic throughout."""
    codes = decode_e2m1(unpack_nibbles(packed)).astype(np.float32)
    group = decode_e4m3fn(scale_bits).astype(np.float32)
    tensor = np.float32(tensor_scale)
    group_scale = group / tensor if divide else group * tensor  # float32 op, one rounding
    out_features, in_features = codes.shape
    grouped = codes.reshape(out_features, in_features // 16, 16) * group_scale[..., None]
    return grouped.reshape(out_features, in_features).astype(np.float32)


def fp8_block_float32(weight_bits: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """FP8 block weight bits [out, in] + float32 scale grid -> float32 [out, in] by an explicit block loop."""
    values = decode_e4m3fn(weight_bits).astype(np.float32)
    out = np.empty_like(values)
    rows, cols = values.shape
    for i in range(0, rows, block[0]):
        for j in range(0, cols, block[1]):
            tile = values[i : i + block[0], j : j + block[1]]
            out[i : i + block[0], j : j + block[1]] = tile * np.float32(scale[i // block[0], j // block[1]])
    return out
