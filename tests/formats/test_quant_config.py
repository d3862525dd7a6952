import json

import pytest
import torch

from moeserve.errors import CheckpointError, UnsupportedModelError
from moeserve.formats.catalog import Fp8BlockFormat
from moeserve.formats.quant_config import load_quant_scheme, parse_quant_config
from moeserve.formats.quantize import quantize_mxfp4

GPT_OSS = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}
FP8 = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
    "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate"],
}
MODELOPT_FILE = {
    "producer": {"name": "modelopt", "version": "0.29.0"},
    "quantization": {
        "quant_algo": "NVFP4",
        "kv_cache_quant_algo": None,
        "group_size": 16,
        "exclude_modules": ["lm_head", "model.layers.*.mlp.gate", "model.layers.0.self_attn*"],
    },
}


def compressed_tensors_config(preset="NVFP4", ct_format="nvfp4-pack-quantized"):
    """The quantization_config compressed-tensors itself writes for `preset`."""
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    scheme = QuantizationScheme(targets=["Linear"], **PRESET_SCHEMES[preset])
    config = QuantizationConfig(
        config_groups={"group_0": scheme}, format=ct_format, ignore=["lm_head", "re:.*mlp.gate$"]
    )
    return config.model_dump(mode="json")


def write_model(tmp_path, quantization_config=None, modelopt_file=None):
    config = {"model_type": "test"}
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (tmp_path / "config.json").write_text(json.dumps(config))
    if modelopt_file is not None:
        (tmp_path / "hf_quant_config.json").write_text(json.dumps(modelopt_file))
    return tmp_path


def test_unquantized_folder(tmp_path):
    scheme = load_quant_scheme(write_model(tmp_path))
    assert scheme.method == "none"
    assert not scheme.is_quantized("model.layers.0.mlp.experts.0.down_proj")
    assert scheme.tensor_names("model.layers.0.mlp.down_proj") == ("model.layers.0.mlp.down_proj.weight",)


def test_gpt_oss_mxfp4(tmp_path):
    scheme = load_quant_scheme(write_model(tmp_path, GPT_OSS))
    experts = "model.layers.3.mlp.experts.gate_up_proj"
    assert scheme.method == "mxfp4" and scheme.is_quantized(experts)
    assert scheme.tensor_names(experts) == (f"{experts}_blocks", f"{experts}_scales")
    for dense in (
        "model.layers.3.self_attn.q_proj",
        "model.layers.12.mlp.router",
        "lm_head",
        "model.embed_tokens",
    ):
        assert not scheme.is_quantized(dense), dense
        assert scheme.tensor_names(dense) == (f"{dense}.weight",)


def test_gpt_oss_dequantize_through_scheme():
    scheme = parse_quant_config(GPT_OSS)
    prefix = "model.layers.0.mlp.experts.down_proj"
    weight = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(0))
    blocks, scales = quantize_mxfp4(weight)
    state = {f"{prefix}_blocks": blocks, f"{prefix}_scales": scales, "unrelated": torch.zeros(1)}
    fmt = scheme.format_for(prefix)
    tensors = fmt.select(prefix, state)
    out = torch.empty(fmt.dequantized_shape(tensors), dtype=torch.bfloat16)
    scheme.dequantize(prefix, tensors, out)
    assert out.shape == (2, 8, 64)
    torch.testing.assert_close(out.float(), weight, atol=weight.abs().max().item() / 2, rtol=0)


def test_compressed_tensors_nvfp4_with_regex_ignore():
    scheme = parse_quant_config(compressed_tensors_config())
    assert scheme.method == "compressed-tensors"
    expert = "model.layers.0.mlp.experts.7.down_proj"
    assert scheme.tensor_names(expert) == tuple(
        f"{expert}.{role}" for role in ("weight_packed", "weight_scale", "weight_global_scale")
    )
    assert scheme.is_quantized("model.layers.0.mlp.gate_proj")  # "re:.*mlp.gate$" is anchored at the end
    assert not scheme.is_quantized("model.layers.0.mlp.gate")
    assert not scheme.is_quantized("lm_head")


def test_compressed_tensors_mxfp4():
    scheme = parse_quant_config(compressed_tensors_config("MXFP4A16", "mxfp4-pack-quantized"))
    assert scheme.format_for("model.layers.1.self_attn.o_proj").roles == ("weight_packed", "weight_scale")


def test_modelopt_from_hf_quant_config_json(tmp_path):
    scheme = load_quant_scheme(write_model(tmp_path, modelopt_file=MODELOPT_FILE))
    assert scheme.method == "modelopt"
    assert scheme.tensor_names("model.layers.1.mlp.experts.0.up_proj")[2].endswith(".weight_scale_2")
    assert not scheme.is_quantized("model.layers.5.mlp.gate")  # fnmatch wildcard
    assert scheme.is_quantized("model.layers.5.mlp.gate_proj")
    assert not scheme.is_quantized("model.layers.0.self_attn.q_proj")  # "self_attn*"
    assert scheme.is_quantized("model.layers.1.self_attn.q_proj")


def test_modelopt_flat_in_config_json():
    flat = {"quant_method": "modelopt", **MODELOPT_FILE["quantization"]}
    assert not parse_quant_config(flat).is_quantized("lm_head")


def test_fp8_block(tmp_path):
    scheme = load_quant_scheme(write_model(tmp_path, {**FP8, "weight_block_size": [128, 64]}))
    assert scheme.format_for("model.layers.1.mlp.experts.3.up_proj") == Fp8BlockFormat(block_size=(128, 64))
    assert (
        scheme.tensor_names("model.layers.1.self_attn.q_proj")[1]
        == "model.layers.1.self_attn.q_proj.weight_scale_inv"
    )
    assert not scheme.is_quantized("model.layers.0.mlp.gate")
    assert scheme.is_quantized("model.layers.0.mlp.gate_proj")  # module-boundary match, not a prefix
    assert scheme.is_quantized("model.layers.10.mlp.gate")  # "layers.0" does not match "layers.10"


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"quant_method": "awq", "bits": 4}, "'awq'"),
        ({"bits": 4}, "<missing quant_method>"),
        ({**FP8, "weight_block_size": None}, "per-tensor fp8"),
        ({"quant_method": "modelopt", "quant_algo": "FP8"}, "'FP8'"),
    ],
)
def test_unsupported_scheme_is_one_clear_line(config, named):
    with pytest.raises(UnsupportedModelError) as caught:
        parse_quant_config(config)
    message = str(caught.value)
    assert named in message and "mxfp4" in message and "nvfp4-pack-quantized" in message
    assert "\n" not in message


def test_unsupported_compressed_tensors_format():
    config = compressed_tensors_config("FP8_DYNAMIC", "float-quantized")
    with pytest.raises(UnsupportedModelError, match="'float-quantized'.*supported schemes"):
        parse_quant_config(config)


def test_missing_or_broken_config_json(tmp_path):
    with pytest.raises(CheckpointError, match="config.json is missing"):
        load_quant_scheme(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot be read as JSON"):
        load_quant_scheme(tmp_path)


def test_scheme_is_frozen():
    scheme = parse_quant_config(GPT_OSS)
    with pytest.raises(AttributeError):
        scheme.method = "fp8"  # type: ignore[misc]
