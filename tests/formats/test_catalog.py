import pytest
import torch

from moeserve.errors import CheckpointError, UnsupportedModelError
from moeserve.formats.catalog import FORMATS, create_format
from moeserve.formats.int8 import quantize_int8_per_channel


def test_registry_lists_every_format():
    assert set(FORMATS) == {
        "dense",
        "mxfp4-gpt-oss",
        "mxfp4-ct",
        "nvfp4-ct",
        "int4-ct",
        "nvfp4-modelopt",
        "fp8-block",
        "fp8-block-e8m0",
        "mxfp4-deepseek",
        "int8-per-channel",
        *(f"gguf-{t}" for t in ("q8_0", "q4_0", "q4_k", "q5_k", "q6_k", "mxfp4")),
    }
    for name, cls in FORMATS.items():
        assert cls.name == name and create_format(name).name == name


def test_unknown_format_lists_the_known_ones():
    with pytest.raises(UnsupportedModelError, match="'gguf-q4'.*fp8-block"):
        create_format("gguf-q4")


def test_options_reach_the_format():
    assert create_format("fp8-block", block_size=(64, 32)).block_size == (64, 32)


def test_select_names_the_missing_tensor():
    fmt = create_format("nvfp4-ct")
    state = {"layer.weight_packed": torch.zeros(1), "layer.weight_scale": torch.zeros(1)}
    with pytest.raises(CheckpointError, match="'layer.weight_global_scale' is missing"):
        fmt.select("layer", state)


def test_dense_and_int8_through_the_interface():
    weight = torch.randn(6, 10, generator=torch.Generator().manual_seed(0))
    dense = create_format("dense")
    out = torch.empty(dense.dequantized_shape({"weight": weight}), dtype=torch.bfloat16)
    dense.dequantize({"weight": weight}, out)
    assert torch.equal(out, weight.to(torch.bfloat16))
    q, scale = quantize_int8_per_channel(weight)
    int8 = create_format("int8-per-channel")
    tensors = int8.select("w", {"w.weight": q, "w.weight_scale": scale})
    out32 = torch.empty(int8.dequantized_shape(tensors))
    int8.dequantize(tensors, out32)
    assert torch.equal(out32, q.float() * scale[:, None])
