import pytest
import torch

from moeserve.errors import CheckpointError
from moeserve.formats.fp8_block import dequantize_fp8_block, fp8_block_scale_shape
from moeserve.formats.quantize import quantize_fp8_block
from tests.formats.numpy_decoders import fp8_block_float32

SHAPES = [(320, 200), (192, 384), (256, 256), (100, 60)]


def random_fp8(shape, block, scale_dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    bits[(bits & 0x7F) == 0x7F] = 0  # drop the two NaN encodings
    scale_shape = fp8_block_scale_shape(shape, block)
    scale = (torch.rand(scale_shape, generator=gen) * 1e-2 + 1e-4).to(scale_dtype)
    return bits.view(torch.float8_e4m3fn), scale


def numpy_reference(weight, scale, block):
    return torch.from_numpy(fp8_block_float32(weight.view(torch.uint8).numpy(), scale.float().numpy(), block))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_matches_numpy_reference(shape, scale_dtype):
    weight, scale = random_fp8(shape, (128, 128), scale_dtype)
    expected = numpy_reference(weight, scale, (128, 128))
    out = torch.empty(shape, dtype=torch.float32)
    dequantize_fp8_block(weight, scale, out)
    assert torch.equal(out, expected)
    out_bf16 = torch.empty(shape, dtype=torch.bfloat16)
    dequantize_fp8_block(weight, scale, out_bf16)
    assert torch.equal(out_bf16, expected.to(torch.bfloat16))  # float32 product, then the cast


def test_other_block_size():
    weight, scale = random_fp8((70, 50), (32, 16), torch.float32, seed=1)
    out = torch.empty(70, 50)
    dequantize_fp8_block(weight, scale, out, block_size=(32, 16))
    assert torch.equal(out, numpy_reference(weight, scale, (32, 16)))


def test_edge_blocks_use_their_own_scale():
    # 192 rows = one full block + a 64-row edge: the edge rows must use scale row 1, not rows // 2 = 96.
    weight = torch.ones(192, 128).to(torch.float8_e4m3fn)
    scale = torch.tensor([[2.0], [3.0]])
    out = torch.empty(192, 128)
    dequantize_fp8_block(weight, scale, out)
    assert out[:128].eq(2.0).all() and out[128:].eq(3.0).all()


@pytest.mark.parametrize("shape", [(320, 200), (192, 384)])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_quantizer_round_trip(shape, scale_dtype):
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    codes, scale_inv = quantize_fp8_block(weight, scale_dtype=scale_dtype)
    assert codes.dtype == torch.float8_e4m3fn and scale_inv.dtype == scale_dtype
    assert tuple(scale_inv.shape) == fp8_block_scale_shape(shape, (128, 128))
    out = torch.empty(shape)
    dequantize_fp8_block(codes, scale_inv, out)
    torch.testing.assert_close(out, weight, rtol=2**-3, atol=1e-2)  # e4m3 keeps 3 mantissa bits


def test_wrong_scale_grid_raises():
    weight, scale = random_fp8((320, 256), (128, 128), torch.float32)
    with pytest.raises(CheckpointError, match=r"needs weight_scale_inv \(3, 2\)"):
        dequantize_fp8_block(weight, scale[:2], torch.empty(320, 256))
