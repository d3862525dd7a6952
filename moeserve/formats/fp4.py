"""E2M1 (FP4) code table and nibble unpacking, shared by MXFP4 and NVFP4.

Byte layout: one byte holds two E2M1 codes. The low nibble (``b & 0x0F``) is element ``2j`` and the high
nibble (``b >> 4``) is element ``2j + 1``. Bit 3 of a code is the sign, bits 0-2 index the magnitude.
Both formats then multiply each contiguous group of elements (32 for MXFP4, 16 for NVFP4) by one scale;
`dequantize_fp4_groups` does that in bounded chunks, given a callback that produces the group scales.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import torch
from torch import Tensor

from moeserve.errors import CheckpointError

# Value of each 4-bit code, indexed by the raw nibble (8..15 are the negatives, 8 is -0.0).
E2M1_VALUES: tuple[float, ...] = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip

# Packed bytes decoded per chunk. Bounds the temporaries: an int32 index buffer of this many entries
# (1 MiB) and a float32 group-scale buffer of at most this many / 8 entries (128 KiB for NVFP4).
CHUNK_BYTES = 1 << 18

# Receives (first_group, group_count, scales_out) and writes `group_count` float32 scales into scales_out.
GroupScaleWriter = Callable[[int, int, Tensor], None]


@lru_cache(maxsize=32)
def e2m1_byte_table(
    dtype: torch.dtype, device: torch.device, code_scale: float = 1.0, nibbles: tuple[float, ...] = E2M1_VALUES
) -> Tensor:
    """Return a ``[256, 2]`` table: byte -> (low-nibble value, high-nibble value), each times ``code_scale``.

    ``nibbles`` is the value of each of the 16 codes (E2M1 by default; formats/int4.py passes the int4 codes).
    Cached per (dtype, device, code_scale, nibbles); callers must not write into it. ``code_scale`` must be a power
    of two small enough that every scaled value stays exact in ``dtype`` (1.0 or 2.0 in practice).
    """
    values = torch.tensor(nibbles, dtype=torch.float32) * code_scale
    codes = torch.arange(256)
    table = torch.stack((values[codes & 0x0F], values[codes >> 4]), dim=1)  # [256, 2]
    return table.to(dtype=dtype, device=device)


def unpack_fp4(packed: Tensor, out: Tensor) -> None:
    """Write the E2M1 value of every nibble of ``packed`` into ``out`` (low nibble first).

    ``packed`` is uint8 of any shape; ``out`` is a contiguous float tensor with ``2 * packed.numel()`` elements,
    row-major in the unpacked order. Temporary: one int32 index buffer of at most `CHUNK_BYTES` entries.
    """
    _check_fp4_pair(packed, out)
    packed_flat = packed.reshape(-1)
    out_pairs = out.view(-1, 2)  # [bytes, 2]: element 2j and 2j+1 of byte j
    table = e2m1_byte_table(out.dtype, out.device)
    index = torch.empty(min(packed_flat.numel(), CHUNK_BYTES), dtype=torch.int32, device=out.device)
    for start in range(0, packed_flat.numel(), CHUNK_BYTES):
        stop = min(start + CHUNK_BYTES, packed_flat.numel())
        _unpack_span(packed_flat[start:stop], out_pairs[start:stop], table, index)


def dequantize_fp4_groups(
    packed: Tensor,
    out: Tensor,
    group_size: int,
    write_scales: GroupScaleWriter,
    code_scale: float = 1.0,
    nibbles: tuple[float, ...] = E2M1_VALUES,
) -> None:
    """Decode E2M1 bytes into ``out`` and multiply each run of ``group_size`` elements by its group scale.

    ``packed`` (uint8, contiguous) holds ``out.numel() / 2`` bytes in output order; ``write_scales`` supplies
    float32 scales for groups in order. Each element is
    ``cast(out.dtype, float32(value * code_scale) * float32(scale))``: a float32 product, then the cast, as the references
    compute it (``code_scale`` lets a caller move a power of two from the scale onto the codes; ``nibbles``: the
    16 code values, E2M1 unless given). Temporaries: an int32 index buffer (`CHUNK_BYTES` entries at
    most) and a float32 scale buffer (``CHUNK_BYTES * 2 / group_size`` entries at most), reused across chunks.
    """
    _check_fp4_pair(packed, out)
    if group_size % 2 or out.numel() % group_size:
        raise ValueError(f"out of {out.numel()} elements does not split into FP4 groups of {group_size}")
    packed_flat = packed.reshape(-1)
    out_groups = out.view(-1, group_size)  # [groups, group_size]
    group_count = out_groups.shape[0]
    bytes_per_group = group_size // 2
    groups_per_chunk = max(1, CHUNK_BYTES // bytes_per_group)
    table = e2m1_byte_table(out.dtype, out.device, code_scale, nibbles)
    chunk_groups = min(group_count, groups_per_chunk)
    index = torch.empty(chunk_groups * bytes_per_group, dtype=torch.int32, device=out.device)
    scales = torch.empty(chunk_groups, dtype=torch.float32, device=out.device)
    for first in range(0, group_count, groups_per_chunk):
        count = min(groups_per_chunk, group_count - first)
        byte_span = slice(first * bytes_per_group, (first + count) * bytes_per_group)
        chunk_out = out_groups[first : first + count]
        _unpack_span(packed_flat[byte_span], chunk_out.view(-1, 2), table, index)
        write_scales(first, count, scales[:count])
        # In-place multiply by a float32 tensor computes in float32, then casts into out.dtype.
        chunk_out.mul_(scales[:count, None])


def _unpack_span(packed_span: Tensor, out_pairs: Tensor, table: Tensor, index: Tensor) -> None:
    # uint8 cannot index (torch would read it as a mask), so widen into the reused int32 buffer first.
    span_index = index[: packed_span.numel()]
    span_index.copy_(packed_span)
    torch.index_select(table, 0, span_index, out=out_pairs)


def _check_fp4_pair(packed: Tensor, out: Tensor) -> None:
    if packed.dtype != torch.uint8:
        raise CheckpointError(f"FP4 packed data must be uint8, got {packed.dtype}")
    if out.numel() != 2 * packed.numel():
        raise ValueError(
            f"out has {out.numel()} elements but {packed.numel()} packed bytes hold {2 * packed.numel()}"
        )
    if not (packed.is_contiguous() and out.is_contiguous()):
        raise ValueError("FP4 packed data and out must both be contiguous")
