import numpy as np
import pytest
import torch

from moeserve.errors import CheckpointError
from moeserve.formats import fp4
from moeserve.formats.catalog import CompressedTensorsNvfp4Format
from moeserve.formats.nvfp4 import dequantize_nvfp4_ct, dequantize_nvfp4_modelopt, nvfp4_output_shape
from tests.formats.numpy_decoders import nvfp4_float32


def ct_scheme():
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4A16

    return QuantizationScheme(targets=["Linear"], **NVFP4A16)


def ct_compress(weight):
    """Bytes written by compressed-tensors' own NVFP4 compressor (independent of moeserve)."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    scheme = ct_scheme()
    global_scale = generate_gparam(weight.min(), weight.max())  # 448 * 6 / amax: a divisor
    groups = weight.view(weight.shape[0], -1, 16)
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights, global_scale=global_scale)
    state = {"weight": weight, "weight_scale": scale, "weight_global_scale": global_scale}
    return NVFP4PackedCompressor.compress(state, scheme)


def ct_decompress(compressed):
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor

    return NVFP4PackedCompressor.decompress(dict(compressed), ct_scheme())["weight"]


def random_weight(rows=48, cols=96, magnitude=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=gen) * magnitude).to(torch.bfloat16)


def run(fn, packed, scale, tensor_scale, dtype):
    out = torch.empty(nvfp4_output_shape(packed, scale), dtype=dtype)
    fn(packed, scale, tensor_scale, out)
    return out


@pytest.mark.parametrize("magnitude", [0.02, 1.0, 300.0])
def test_ct_convention_matches_compressed_tensors(magnitude):
    compressed = ct_compress(random_weight(magnitude=magnitude))
    assert compressed["weight_scale"].dtype == torch.float8_e4m3fn
    reference = ct_decompress(compressed)
    ours = run(
        dequantize_nvfp4_ct,
        compressed["weight_packed"],
        compressed["weight_scale"],
        compressed["weight_global_scale"],
        reference.dtype,
    )
    assert torch.equal(ours, reference)


@pytest.mark.parametrize("magnitude", [0.02, 1.0, 300.0])
def test_modelopt_convention_matches_torchao(magnitude):
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor

    compressed = ct_compress(random_weight(magnitude=magnitude, seed=1))
    packed, scale = compressed["weight_packed"], compressed["weight_scale"]
    weight_scale_2 = (1.0 / compressed["weight_global_scale"]).reshape(())  # ModelOpt: a multiplier
    for dtype in (torch.bfloat16, torch.float32):
        reference = NVFP4Tensor(packed, scale, 16, dtype, per_tensor_scale=weight_scale_2).dequantize(dtype)
        assert torch.equal(run(dequantize_nvfp4_modelopt, packed, scale, weight_scale_2, dtype), reference)


@pytest.mark.parametrize("divide", [True, False])
def test_float32_matches_numpy_decoder(divide):
    compressed = ct_compress(random_weight(seed=2))
    packed, scale, tensor_scale = (
        compressed["weight_packed"],
        compressed["weight_scale"],
        compressed["weight_global_scale"],
    )
    expected = nvfp4_float32(packed.numpy(), scale.view(torch.uint8).numpy(), tensor_scale.item(), divide)
    fn = dequantize_nvfp4_ct if divide else dequantize_nvfp4_modelopt
    assert torch.equal(run(fn, packed, scale, tensor_scale, torch.float32), torch.from_numpy(expected))


def test_modelopt_equals_ct_with_reciprocal_global():
    compressed = ct_compress(random_weight(seed=3))
    packed, scale = compressed["weight_packed"], compressed["weight_scale"]
    # A power-of-two global has an exact reciprocal, so the two conventions must agree bit for bit.
    global_scale = torch.tensor([2.0**10])
    ct = run(dequantize_nvfp4_ct, packed, scale, global_scale, torch.float32)
    assert torch.equal(run(dequantize_nvfp4_modelopt, packed, scale, 1.0 / global_scale, torch.float32), ct)
    # Any other global: x / g and x * (1/g) differ by at most one float32 rounding each way.
    global_scale = compressed["weight_global_scale"]
    ct = run(dequantize_nvfp4_ct, packed, scale, global_scale, torch.float32)
    modelopt = run(dequantize_nvfp4_modelopt, packed, scale, 1.0 / global_scale, torch.float32)
    torch.testing.assert_close(modelopt, ct, rtol=2**-22, atol=0)


def test_fused_shards_keep_their_own_global_scale():
    # gate and up of one expert, quantized separately: their global scales differ by ~100x.
    shards = [ct_compress(random_weight(rows=32, magnitude=m, seed=4)) for m in (0.01, 1.0)]
    assert shards[0]["weight_global_scale"].item() != pytest.approx(shards[1]["weight_global_scale"].item())
    fmt = CompressedTensorsNvfp4Format()
    fused = torch.empty(64, 96, dtype=torch.bfloat16)
    for index, shard in enumerate(shards):
        fmt.dequantize(shard, fused[index * 32 : (index + 1) * 32])
    expected = torch.cat([ct_decompress(shard) for shard in shards])
    assert torch.equal(fused, expected)


def test_many_chunks_equal_one_chunk(monkeypatch):
    compressed = ct_compress(random_weight(seed=5))
    args = (compressed["weight_packed"], compressed["weight_scale"], compressed["weight_global_scale"])
    whole = run(dequantize_nvfp4_ct, *args, torch.bfloat16)
    monkeypatch.setattr(fp4, "CHUNK_BYTES", 40)  # 5 groups per chunk
    assert torch.equal(run(dequantize_nvfp4_ct, *args, torch.bfloat16), whole)


def test_bad_inputs_raise():
    packed = torch.zeros(4, 8, dtype=torch.uint8)
    scale = torch.zeros(4, 1, dtype=torch.float8_e4m3fn)
    with pytest.raises(CheckpointError, match="does not match"):
        nvfp4_output_shape(packed, torch.zeros(4, 2, dtype=torch.float8_e4m3fn))
    with pytest.raises(CheckpointError, match="one value"):
        dequantize_nvfp4_ct(packed, scale, torch.ones(2), torch.empty(4, 16))
    assert np.prod(nvfp4_output_shape(packed, scale)) == 64
