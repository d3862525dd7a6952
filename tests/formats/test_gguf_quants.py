"""The GGUF dequantizers (checkpoint/gguf/quants.py, through the gguf-* formats of formats/gguf.py) against the gguf
package's reference `gguf.quants.dequantize`, bit for bit: random blocks of every type moeserve reads (finite f16
scales: a real file's), and blocks the gguf package's own quantizer writes (Q8_0, Q4_0, MXFP4, BF16; F16 by numpy).
A type moeserve does not read has no format."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeserve.checkpoint.gguf.quants import TYPES_BY_NAME, dequantize
from moeserve.formats.catalog import FORMATS, create_format

gguf = pytest.importorskip("gguf")

READ = ("Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4", "BF16", "F16")
# byte offsets of each block's f16 scales (random bytes there could be NaN or inf, which no quantizer writes)
F16_FIELDS = {"Q8_0": (0, 2), "Q4_0": (0, 2), "Q4_K": (0, 4), "Q5_K": (0, 4), "Q6_K": (208, 210)}


def random_blocks(type_name: str, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    q = gguf.GGMLQuantizationType[type_name]
    _, block_bytes = gguf.GGML_QUANT_SIZES[q]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, blocks_per_row, block_bytes), dtype=np.uint8)
    if type_name in F16_FIELDS:
        lo, hi = F16_FIELDS[type_name]
        raw[..., lo:hi] = rng.standard_normal((rows, blocks_per_row, (hi - lo) // 2)).astype(np.float16).view(np.uint8)
    if type_name in ("BF16", "F16"):  # finite values: random exponents and mantissas, no all-ones exponent
        dtype = np.float16 if type_name == "F16" else np.float32
        values = (rng.standard_normal(raw.size // 2) * 10.0 ** rng.integers(-6, 6, raw.size // 2)).astype(dtype)
        raw = (values.view(np.uint16) if type_name == "F16" else (values.view(np.uint32) >> 16).astype(np.uint16)
               ).view(np.uint8).reshape(rows, blocks_per_row, block_bytes)
    return raw.reshape(rows, -1)


def assert_bits_equal(stored: np.ndarray, type_name: str) -> None:
    ref = gguf.quants.dequantize(stored, gguf.GGMLQuantizationType[type_name])
    got = dequantize(torch.from_numpy(stored), TYPES_BY_NAME[type_name]).numpy()
    assert got.shape == ref.shape and got.dtype == np.float32
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), type_name


@pytest.mark.filterwarnings("ignore:overflow encountered")  # the reference on an MXFP4 exponent of 255: inf
@pytest.mark.parametrize("type_name", READ)
def test_random_blocks_decode_as_the_reference_does(type_name: str) -> None:
    for seed in range(3):
        assert_bits_equal(random_blocks(type_name, rows=5, blocks_per_row=3, seed=seed), type_name)


@pytest.mark.parametrize("type_name", ("Q8_0", "Q4_0", "MXFP4", "BF16"))
def test_blocks_the_gguf_quantizer_writes_decode_as_the_reference_does(type_name: str) -> None:
    rng = np.random.default_rng(1)
    values = (rng.standard_normal((6, 256)) * rng.uniform(1e-3, 4.0, (6, 1))).astype(np.float32)
    values[0, :40] = 0.0  # an all-zero block (scale 0)
    assert_bits_equal(gguf.quants.quantize(values, gguf.GGMLQuantizationType[type_name]), type_name)
    assert_bits_equal(values.astype(np.float16).view(np.uint8), "F16")


@pytest.mark.parametrize("type_name", [t for t in READ if t not in ("BF16", "F16")])
def test_the_format_writes_the_reference_values_rounded_once_into_the_output(type_name: str) -> None:
    fmt = create_format(f"gguf-{type_name.lower()}")
    stored = random_blocks(type_name, rows=4, blocks_per_row=2, seed=9)
    weight = torch.from_numpy(stored)
    shape = fmt.dequantized_shape({"weight": weight})
    assert fmt.stored_shapes(shape, "BF16") == {"weight": ("U8", tuple(weight.shape))}
    ref = torch.from_numpy(gguf.quants.dequantize(stored, gguf.GGMLQuantizationType[type_name]))
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.empty(shape, dtype=dtype)
        fmt.dequantize({"weight": weight}, out)
        assert torch.equal(out, ref.to(dtype))


def test_only_the_types_read_have_a_format() -> None:
    gguf_formats = {name for name in FORMATS if name.startswith("gguf-")}
    assert gguf_formats == {f"gguf-{t.lower()}" for t in READ if t not in ("BF16", "F16")}
