import pytest
import torch

from moeserve.formats.int8 import dequantize_int8_per_channel, quantize_int8_per_channel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_error_is_half_a_step(dtype):
    weight = (torch.randn(24, 80, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    weight[5] = 0  # an all-zero row
    q, scale = quantize_int8_per_channel(weight)
    assert q.dtype == torch.int8 and q.shape == weight.shape
    assert scale.dtype == torch.float32 and scale.shape == (24,)
    assert int(q.abs().max()) == 127
    out = torch.empty(weight.shape, dtype=torch.float32)
    dequantize_int8_per_channel(q, scale, out)
    error = (out - weight.float()).abs()
    assert bool((error <= scale[:, None] / 2 * (1 + 2**-20)).all())
    assert out[5].eq(0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequant_is_exact_float32_product(dtype):
    q, scale = quantize_int8_per_channel(torch.randn(16, 32, generator=torch.Generator().manual_seed(1)))
    out = torch.empty(16, 32, dtype=dtype)
    dequantize_int8_per_channel(q, scale, out)
    expected = (q.double() * scale.double()[:, None]).float()  # exact product, then float32 rounding
    assert torch.equal(out, expected.to(dtype))


def test_rejects_bad_shapes():
    q, scale = quantize_int8_per_channel(torch.randn(4, 8))
    with pytest.raises(ValueError, match="scale"):
        dequantize_int8_per_channel(q, scale[:3], torch.empty(4, 8))
    with pytest.raises(ValueError, match="2-D"):
        quantize_int8_per_channel(torch.randn(8))
