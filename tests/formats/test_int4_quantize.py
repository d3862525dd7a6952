"""quantization="int4"'s quantizer (formats/int4.quantize_int4_packed) writes the bytes compressed-tensors' own
quantizer and packer write for the same bf16 weight (Kimi-K2's W4A16 scheme: int4, symmetric, group 32), and its
weights decode back within half a step."""

from __future__ import annotations

import pytest
import torch

from moeserve.formats.int4 import dequantize_int4_packed, quantize_int4_packed
from tests.models.test_int4_pack_quantized import GROUP_SIZE, ct_compress


@pytest.mark.parametrize("seed", [0, 1])
def test_bytes_equal_compressed_tensors(seed):
    pytest.importorskip("compressed_tensors")
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(64, 256, generator=gen) * torch.rand(64, 1, generator=gen)).bfloat16()
    w[3, 32:64] = 0.5  # a group of equal values: every code saturates at +7 or -8 by the scale's rounding
    packed, scale = quantize_int4_packed(w, GROUP_SIZE)
    ref = ct_compress(w)
    assert torch.equal(scale, ref["weight_scale"]) and scale.dtype == torch.bfloat16
    assert torch.equal(packed, ref["weight_packed"])


def test_round_trip_within_half_a_step():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(16, 128, generator=gen).bfloat16()
    w[0, :32] = 0  # an all-zero group: scale 1, codes 0
    packed, scale = quantize_int4_packed(w, 32)
    out = torch.empty(16, 128)
    dequantize_int4_packed(packed, scale, out, 32)
    step = scale.float().repeat_interleave(32, dim=1)
    err = (out - w.float()).abs()
    assert (err <= step).all()  # half a step, or one where +amax is clamped from 8 to 7
    assert (err <= step / 2).float().mean() > 0.95
    assert torch.equal(out[0, :32], torch.zeros(32)) and scale[0, 0] == 1


def test_refuses_a_width_that_does_not_split_into_groups():
    with pytest.raises(ValueError, match="groups of 32"):
        quantize_int4_packed(torch.zeros(4, 48), 32)
