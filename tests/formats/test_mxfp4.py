import numpy as np
import pytest
import torch

from moeserve.errors import CheckpointError
from moeserve.formats import fp4
from moeserve.formats.mxfp4 import dequantize_mxfp4, mxfp4_output_shape
from moeserve.formats.quantize import quantize_mxfp4
from tests.formats.numpy_decoders import mxfp4_float32


def random_mxfp4(experts=3, rows=40, groups=5, seed=0, scale_range=(0, 256)):
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, rows, groups, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(*scale_range, (experts, rows, groups), dtype=torch.uint8, generator=gen)
    return blocks, scales


def dequantized(blocks, scales, dtype):
    out = torch.empty(mxfp4_output_shape(blocks, scales), dtype=dtype)
    dequantize_mxfp4(blocks, scales, out)
    return out


def assert_bits_equal(actual, expected):
    # torch.equal treats NaN != NaN; compare NaN positions separately, everything else bit for bit.
    assert torch.equal(actual.isnan(), expected.isnan())
    assert torch.equal(actual.nan_to_num(), expected.nan_to_num())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_transformers_on_every_scale_byte(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = random_mxfp4()  # all 256 scale bytes, 255 (NaN in OCP) included
    reference = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, in, out]
    assert_bits_equal(dequantized(blocks, scales, dtype), reference.transpose(1, 2))


def test_float32_matches_numpy_decoder():
    blocks, scales = random_mxfp4(seed=1)
    expected = torch.from_numpy(mxfp4_float32(blocks.numpy(), scales.numpy()))
    assert_bits_equal(dequantized(blocks, scales, torch.float32), expected)


def test_many_chunks_equal_one_chunk(monkeypatch):
    blocks, scales = random_mxfp4(seed=2, scale_range=(100, 150))
    whole = dequantized(blocks, scales, torch.bfloat16)
    monkeypatch.setattr(fp4, "CHUNK_BYTES", 48)  # 3 groups per chunk, a partial last chunk
    assert torch.equal(dequantized(blocks, scales, torch.bfloat16), whole)


def test_compressed_tensors_layout_is_gpt_oss_reshaped():
    blocks, scales = random_mxfp4(experts=1, seed=3, scale_range=(110, 140))
    gpt_oss = dequantized(blocks, scales, torch.bfloat16)[0]
    weight_packed = blocks[0].reshape(blocks.shape[1], -1)  # [out, in/2]
    weight_scale = scales[0]  # [out, in/32]
    assert torch.equal(dequantized(weight_packed, weight_scale, torch.bfloat16), gpt_oss)


def test_compressed_tensors_decoder_agrees():
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import MXFP4A16

    blocks, scales = random_mxfp4(experts=1, seed=4, scale_range=(110, 140))
    weight_packed, weight_scale = blocks[0].reshape(blocks.shape[1], -1), scales[0]
    scheme = QuantizationScheme(targets=["Linear"], **MXFP4A16)
    state = {"weight_packed": weight_packed, "weight_scale": weight_scale}
    reference = MXFP4PackedCompressor.decompress(state, scheme)["weight"]
    ours = dequantized(weight_packed, weight_scale, reference.dtype)
    assert torch.equal(ours, reference)


def test_quantizer_round_trips_representable_values():
    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (4, 64), generator=gen)
    codes[:, ::32] = 7  # each block holds a 6.0 so its amax fixes the exponent
    exponents = torch.randint(-10, 10, (4, 2), generator=gen).repeat_interleave(32, dim=1)
    weight = torch.ldexp(torch.tensor(fp4.E2M1_VALUES)[codes], exponents.float())
    blocks, scales = quantize_mxfp4(weight)
    assert blocks.shape == (4, 2, 16) and scales.shape == (4, 2)
    assert torch.equal(dequantized(blocks, scales, torch.float32), weight)


def test_quantizer_error_is_bounded():
    weight = torch.randn(8, 96, generator=torch.Generator().manual_seed(6))
    blocks, scales = quantize_mxfp4(weight)
    error = (dequantized(blocks, scales, torch.float32) - weight).abs().view(8, 3, 32)
    block_amax = weight.abs().view(8, 3, 32).amax(dim=-1, keepdim=True)
    # 2**e <= amax / 4; rounding loses <= 1 unit of 2**e, saturation above 6 * 2**e loses < 2 units.
    assert bool((error <= block_amax / 2).all())


def test_mismatched_shapes_raise_checkpoint_error():
    blocks, scales = random_mxfp4()
    with pytest.raises(CheckpointError, match="do not match"):
        mxfp4_output_shape(blocks, scales[..., :-1])
    with pytest.raises(ValueError, match="out has shape"):
        dequantize_mxfp4(blocks, scales, torch.empty(1, dtype=torch.bfloat16))
    assert np.prod(mxfp4_output_shape(blocks, scales)) == blocks.numel() * 2
