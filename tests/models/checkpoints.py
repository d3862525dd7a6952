"""Tiny quantized checkpoints for model tests, and the dense references they are checked against.

Every quantized checkpoint starts from a bf16 checkpoint that transformers wrote itself. Its Linears are then
replaced by the stored tensors of a format, written by an independent packer where one exists
(compressed-tensors' own NVFP4 compressor; our MXFP4 / FP8 packers where no CPU writer exists). The matching
reference is the same bf16 checkpoint with each quantized Linear replaced by an INDEPENDENT dequantization of
the same bytes (compressed-tensors' decompressor, torchao's NVFP4Tensor, numpy decoders), loaded by transformers.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tests.conftest import write_tiny_checkpoint

# gpt-oss with every feature on and dims that MXFP4 can pack (multiples of 32); sliding window 4 on layer 0.
GPT_OSS_TINY: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, num_local_experts=4, num_experts_per_tok=2, vocab_size=300, sliding_window=4,
    max_position_embeddings=512, initializer_range=0.08,
)  # fmt: skip
GPT_OSS_NOT_CONVERTED = [
    "model.layers.*.self_attn",
    "model.layers.*.mlp.router",
    "model.embed_tokens",
    "lm_head",
]

# StoredWeights: checkpoint tensors of one quantized Linear, keyed by full name.
Quantizer = Callable[[str, torch.Tensor], dict[str, torch.Tensor]]
# Reference dequantization: (module prefix, its stored tensors by full name) -> dense bf16 weight.
Reference = Callable[[str, dict[str, torch.Tensor]], torch.Tensor]


def write_gpt_oss(folder: Path, dtype: str = "bfloat16", seed: int = 0, **overrides: Any) -> Path:
    """Random-init GptOssForCausalLM saved by transformers (the bf16 HF layout, stacked experts)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gpt_oss", **{**GPT_OSS_TINY, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    randomize_gpt_oss_zeros(model)
    model.save_pretrained(folder)
    return folder


def randomize_gpt_oss_zeros(model: Any) -> None:
    """transformers inits gpt-oss expert biases and sinks to zero: give them values so they are tested."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.experts.gate_up_proj_bias.normal_(0.0, 0.08)
            layer.mlp.experts.down_proj_bias.normal_(0.0, 0.08)
            layer.self_attn.sinks.normal_(0.0, 1.0)


def randomize_zero_inits(model: Any, std: float = 0.1) -> None:
    """transformers inits the routing correction biases (e_score_correction_bias) to zero: give them values, so the
    choice they shift (and only the choice: the weights are the unbiased scores) is tested."""
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, std)
        # zero-centred RMSNorms (Qwen3-Next, Qwen3.5) init their weight w to 0 (scale 1 + w): give them values, so a
        # norm that scaled by w, or ignored it, is caught
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") and param.dim() == 1 and not param.any():
                param.normal_(0.0, std)


def write_gpt_oss_mxfp4(src: Path, folder: Path) -> Path:
    """The real HF MXFP4 layout: each stacked expert projection [E, in, out] becomes `_blocks`/`_scales`."""
    from moeserve.formats.quantize import quantize_mxfp4

    state = load_file(src / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize_mxfp4(
                tensor.transpose(1, 2).contiguous()
            )  # [E, out, in]: rows = outputs
            out[name + "_blocks"], out[name + "_scales"] = blocks, scales
        else:
            out[name] = tensor
    quant = {"quant_method": "mxfp4", "modules_to_not_convert": GPT_OSS_NOT_CONVERTED}
    return _write(src, folder, out, quant)


def qwen3_base(folder: Path, seed: int = 0, **overrides: Any) -> Path:
    return write_tiny_checkpoint(folder, "qwen3_moe", "bfloat16", seed, **overrides)


def is_quantized_linear(name: str) -> bool:
    """Qwen3-MoE Linears a quantizer converts: every *_proj (attention, experts, dense MLP); not the router,
    lm_head, norms or embeddings (as llm-compressor's usual `ignore: [lm_head, re:.*mlp.gate$]`)."""
    return name.endswith("_proj.weight")


def quantize_checkpoint(
    src: Path,
    folder: Path,
    quantize: Quantizer,
    quant_config: dict[str, Any] | None,
    extra_files: dict[str, Any] | None = None,
) -> Path:
    """Copy `src` with every `is_quantized_linear` weight replaced by `quantize(module prefix, weight)`."""
    state = load_file(src / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if is_quantized_linear(name):
            out.update(quantize(name.removesuffix(".weight"), tensor))
        else:
            out[name] = tensor
    _write(src, folder, out, quant_config)
    for file_name, content in (extra_files or {}).items():
        (folder / file_name).write_text(json.dumps(content))
    return folder


def dequantized_reference(
    src: Path, quantized: Path, folder: Path, reference: Reference, dtype: torch.dtype = torch.bfloat16
) -> Path:
    """`src` with each quantized Linear replaced by `reference`'s dequantization of the stored bytes in
    `quantized` (cast to `dtype`), written under the original names so transformers loads it as an ordinary
    model."""
    stored = load_file(quantized / "model.safetensors")
    state = load_file(src / "model.safetensors")
    for name in list(state):
        if is_quantized_linear(name):
            prefix = name.removesuffix(".weight")
            mine = {k: v for k, v in stored.items() if k.rsplit(".", 1)[0] == prefix}
            state[name] = reference(prefix, mine).to(dtype).contiguous()
    return _write(src, folder, state, None)


def _write(
    src: Path, folder: Path, state: dict[str, torch.Tensor], quant_config: dict[str, Any] | None
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    if quant_config is not None:
        config["quantization_config"] = quant_config
    (folder / "config.json").write_text(json.dumps(config))
    for extra in ("generation_config.json",):
        if (src / extra).is_file():
            shutil.copy(src / extra, folder / extra)
    return folder


# ------------------------------------------------------------------------------ formats: writers and references
def _nvfp4_scheme() -> Any:
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4A16

    return QuantizationScheme(targets=["Linear"], **NVFP4A16)


def nvfp4_ct_quantize(prefix: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors' own NVFP4 compressor (per-tensor global scale, a divisor)."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    scheme = _nvfp4_scheme()
    global_scale = generate_gparam(weight.min(), weight.max())
    groups = weight.view(weight.shape[0], -1, 16)
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights, global_scale=global_scale)
    state = {"weight": weight, "weight_scale": scale, "weight_global_scale": global_scale}
    compressed = NVFP4PackedCompressor.compress(state, scheme)
    return {
        f"{prefix}.{role}": compressed[role]
        for role in ("weight_packed", "weight_scale", "weight_global_scale")
    }


def nvfp4_ct_reference(prefix: str, stored: dict[str, torch.Tensor]) -> torch.Tensor:
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor

    roles = {k.rsplit(".", 1)[1]: v for k, v in stored.items()}
    return NVFP4PackedCompressor.decompress(roles, _nvfp4_scheme())["weight"]


NVFP4_CT_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "nvfp4-pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "format": "nvfp4-pack-quantized", "weights": {
        "num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True}}},
    "ignore": ["lm_head", "re:.*mlp.gate$"],
}  # fmt: skip


def nvfp4_modelopt_quantize(prefix: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """The same bytes as compressed-tensors, ModelOpt names: `weight_scale_2` = 1 / weight_global_scale."""
    ct = nvfp4_ct_quantize(prefix, weight)
    return {
        f"{prefix}.weight": ct[f"{prefix}.weight_packed"],
        f"{prefix}.weight_scale": ct[f"{prefix}.weight_scale"],
        f"{prefix}.weight_scale_2": (1.0 / ct[f"{prefix}.weight_global_scale"]).reshape(()),
    }


def nvfp4_modelopt_reference(prefix: str, stored: dict[str, torch.Tensor]) -> torch.Tensor:
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor

    roles = {k.rsplit(".", 1)[1]: v for k, v in stored.items()}
    tensor = NVFP4Tensor(
        roles["weight"], roles["weight_scale"], 16, torch.bfloat16, per_tensor_scale=roles["weight_scale_2"]
    )
    return tensor.dequantize(torch.bfloat16)


MODELOPT_HF_QUANT_CONFIG = {
    "producer": {"name": "modelopt"},
    "quantization": {"quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None,
                     "exclude_modules": ["lm_head", "*.mlp.gate"]},
}  # fmt: skip

FP8_BLOCK = (32, 32)  # small blocks so the tiny dims (64, 40, 72) have partial edge blocks


def fp8_block_quantize(prefix: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    from moeserve.formats.quantize import quantize_fp8_block

    codes, scale_inv = quantize_fp8_block(weight, FP8_BLOCK, torch.float32)
    return {f"{prefix}.weight": codes, f"{prefix}.weight_scale_inv": scale_inv}


def fp8_block_reference(prefix: str, stored: dict[str, torch.Tensor]) -> torch.Tensor:
    from tests.formats.numpy_decoders import fp8_block_float32

    codes, scale = stored[f"{prefix}.weight"], stored[f"{prefix}.weight_scale_inv"]
    dense = fp8_block_float32(codes.view(torch.uint8).numpy(), scale.float().numpy(), FP8_BLOCK)
    return torch.from_numpy(dense)


FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": list(FP8_BLOCK), "modules_to_not_convert": ["lm_head", "mlp.gate"]}  # fmt: skip


def mxfp4_ct_quantize(prefix: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors `mxfp4-pack-quantized`: our packer's blocks flattened to [out, in/2]."""
    from moeserve.formats.quantize import quantize_mxfp4

    blocks, scales = quantize_mxfp4(weight)
    return {f"{prefix}.weight_packed": blocks.reshape(weight.shape[0], -1), f"{prefix}.weight_scale": scales}


def mxfp4_ct_reference(prefix: str, stored: dict[str, torch.Tensor]) -> torch.Tensor:
    from tests.formats.numpy_decoders import mxfp4_float32

    packed, scales = stored[f"{prefix}.weight_packed"], stored[f"{prefix}.weight_scale"]
    blocks = packed.reshape(*scales.shape, 16)
    return torch.from_numpy(mxfp4_float32(blocks.numpy(), scales.numpy()))


MXFP4_CT_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "format": "mxfp4-pack-quantized", "weights": {
        "num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True}}},
    "ignore": ["lm_head", "re:.*mlp.gate$"],
}  # fmt: skip


# ------------------------------------------------------------------ header-only checkpoints with real shapes
_DTYPE_BYTES = {"BF16": 2, "U8": 1, "F32": 4}


def write_header_only(folder: Path, shapes: dict[str, tuple[str, list[int]]], config: dict[str, Any]) -> Path:
    """A safetensors file with a real header and a sparse (unwritten) data section: real sizes, ~no disk use.
    For tests of planning and reporting that never read the data."""
    import struct

    header, offset = {}, 0
    for name, (dtype, shape) in shapes.items():
        nbytes = _DTYPE_BYTES[dtype]
        for dim in shape:
            nbytes *= dim
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        f.truncate(8 + len(encoded) + offset)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def gpt_oss_20b_header_only(folder: Path) -> Path:
    """gpt-oss-20b's MXFP4 HF layout (shapes and config as docs/formats.md gives them), without the data."""
    E, H, I, L, V, nh, nkv, d = 32, 2880, 2880, 24, 201088, 64, 8, 64  # noqa: E741 (the paper's names)
    shapes: dict[str, tuple[str, list[int]]] = {
        "model.embed_tokens.weight": ("BF16", [V, H]), "lm_head.weight": ("BF16", [V, H]),
        "model.norm.weight": ("BF16", [H]),
    }  # fmt: skip
    for layer in range(L):
        p = f"model.layers.{layer}."
        shapes.update({
            p + "input_layernorm.weight": ("BF16", [H]), p + "post_attention_layernorm.weight": ("BF16", [H]),
            p + "self_attn.q_proj.weight": ("BF16", [nh * d, H]), p + "self_attn.q_proj.bias": ("BF16", [nh * d]),
            p + "self_attn.k_proj.weight": ("BF16", [nkv * d, H]), p + "self_attn.k_proj.bias": ("BF16", [nkv * d]),
            p + "self_attn.v_proj.weight": ("BF16", [nkv * d, H]), p + "self_attn.v_proj.bias": ("BF16", [nkv * d]),
            p + "self_attn.o_proj.weight": ("BF16", [H, nh * d]), p + "self_attn.o_proj.bias": ("BF16", [H]),
            p + "self_attn.sinks": ("BF16", [nh]),
            p + "mlp.router.weight": ("BF16", [E, H]), p + "mlp.router.bias": ("BF16", [E]),
            p + "mlp.experts.gate_up_proj_blocks": ("U8", [E, 2 * I, H // 32, 16]),
            p + "mlp.experts.gate_up_proj_scales": ("U8", [E, 2 * I, H // 32]),
            p + "mlp.experts.gate_up_proj_bias": ("BF16", [E, 2 * I]),
            p + "mlp.experts.down_proj_blocks": ("U8", [E, H, I // 32, 16]),
            p + "mlp.experts.down_proj_scales": ("U8", [E, H, I // 32]),
            p + "mlp.experts.down_proj_bias": ("BF16", [E, H]),
        })  # fmt: skip
    config = {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": H, "intermediate_size": I,
        "num_hidden_layers": L, "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": d,
        "num_local_experts": E, "experts_per_token": 4, "vocab_size": V, "sliding_window": 128,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 150000, "swiglu_limit": 7.0,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": 4096},
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": GPT_OSS_NOT_CONVERTED},
    }  # fmt: skip
    return write_header_only(folder, shapes, config)
