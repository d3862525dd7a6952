"""Qwen3.5 MoE (and Qwen3-Next) NVFP4 checkpoints in the two published layouts, written from a bf16 checkpoint
transformers saved.

What the published NVFP4 checkpoints of Qwen3.5-35B-A3B (and Qwen3-Next-80B-A3B: the same layer kinds) hold, and
so what these writers produce (sources in docs/qwen3_5_nvfp4.md):

- compressed-tensors ``nvfp4-pack-quantized`` (llm-compressor's examples/quantization_w4a4_fp4/qwen3_5_example.py,
  the recipe of e.g. ig1/Qwen3.5-35B-A3B-NVFP4): llm-compressor unfuses the 3-D experts into one Linear per expert
  and projection (``mlp.experts.{E}.gate_proj``; the names transformers' save_pretrained writes for the bf16 model
  too), quantizes every Linear (experts, shared expert, full-attention q/k/v/o) but the example's ignore list
  (lm_head, the vision tower, the router ``mlp.gate``, embed_tokens, ``shared_expert_gate``, every ``linear_attn``
  Linear). Each quantized Linear stores ``weight_packed``, ``weight_scale``, ``weight_global_scale`` and, for the
  W4A4 scheme, ``input_global_scale``. config.json's ``ignore`` is the list compressed-tensors' own
  `QuantizationConfig.from_pretrained` expands (every ignored Linear by name); the MTP tensors are copied beside by
  compressed-tensors' `save_mtp_tensors_to_checkpoint` (its own shard, an index, ``re:^mtp.*`` added to ignore).
- NVIDIA ModelOpt NVFP4 (``hf_quant_config.json``; newer ModelOpt also writes config.json ``quantization_config``
  with ``quant_method: modelopt`` and the exclude list as ``ignore``): the default NVFP4 config disables only the
  routers, ``shared_expert_gate``, ``linear_attn.conv1d`` and lm_head, so the Gated DeltaNet projections are
  quantized too; the vision tower and MTP are left out by the exporter. Each quantized Linear stores ``weight``,
  ``weight_scale``, ``weight_scale_2`` and ``input_scale``.

The 4-bit bytes are compressed-tensors' own NVFP4 compressor's (tests/models/checkpoints.py); ModelOpt's are the
same bytes with ``weight_scale_2 = 1 / weight_global_scale`` (the formulas of both producers agree).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tests.models import checkpoints as C

# llm-compressor's ignore lists, verbatim: examples/quantization_w4a4_fp4/qwen3_5_example.py and qwen3_next_example.py
LLMCOMPRESSOR_IGNORE = {
    "Qwen3_5MoeForConditionalGeneration": [
        "re:.*lm_head", "re:visual.*", "re:model.visual.*", "re:.*mlp.gate$", "re:.*embed_tokens$",
        "re:.*shared_expert_gate$", "re:.*linear_attn.*"],
    "Qwen3NextForCausalLM": ["lm_head", "re:.*mlp.gate$", "re:.*mlp.shared_expert_gate$", "re:.*linear_attn.*"],
}
ACTIVATION_AMAX = 4.0  # a calibrated activation range: only its presence matters (weight-only serving)


def write_qwen35(folder: Path, text: dict[str, Any], vision: dict[str, Any], dtype: torch.dtype,
                 seed: int = 0) -> Path:
    """A random Qwen3_5MoeForConditionalGeneration (vision tower included) saved by transformers in `dtype`, plus the
    mtp.* tensors the published checkpoints carry (transformers' class has none)."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    config = Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen3_5MoeForConditionalGeneration(config).to(dtype).eval()
    C.randomize_zero_inits(model)
    model.save_pretrained(folder)
    state = load_file(folder / "model.safetensors")
    h = text["hidden_size"]
    state |= {"mtp.fc.weight": torch.randn(h, 2 * h).to(dtype), "mtp.norm.weight": torch.randn(h).to(dtype),
              "mtp.layers.0.mlp.experts.0.up_proj.weight": torch.randn(8, h).to(dtype)}
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


# ---------------------------------------------------------------------------------- compressed-tensors (llm-compressor)
def ct_quant_config(src: Path) -> tuple[dict[str, Any], set[str]]:
    """compressed-tensors' own config for the model at `src` (Qwen3.5 or Qwen3-Next) as llm-compressor's recipe
    quantizes it: the NVFP4 scheme applied (`apply_quantization_config`) to the model with its experts unfused into
    Linears, and `QuantizationConfig.from_pretrained` reading it back (the ``ignore`` list it expands). Returns the
    config dict and the names of the quantized modules."""
    import transformers
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.quant_scheme import NVFP4

    architecture = json.loads((src / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, architecture).from_pretrained(src, dtype=torch.float32)
    _unfuse_experts(model)
    scheme = QuantizationScheme(targets=["Linear"], **NVFP4)
    recipe = QuantizationConfig(config_groups={"group_0": scheme}, ignore=LLMCOMPRESSOR_IGNORE[architecture])
    apply_quantization_config(model, recipe)
    quantized = {name for name, module in model.named_modules() if getattr(module, "quantization_scheme", None)}
    saved = QuantizationConfig.from_pretrained(model, format="nvfp4-pack-quantized")
    assert saved is not None
    saved.quantization_status = QuantizationStatus.COMPRESSED
    return saved.model_dump(mode="json"), quantized


def _unfuse_experts(model: Any) -> None:
    """The 3-D expert parameters of every MoE block as one MLP (three Linears) per expert, of the shared expert's
    class, as llm-compressor's CalibrationQwen3_5MoeSparseMoeBlock / Qwen3-Next block do before quantizing
    (gate_up_proj rows: gate, then up)."""
    for block in [m for m in model.modules() if hasattr(getattr(m, "experts", None), "gate_up_proj")]:
        fused, mlp_class, config = block.experts, type(block.shared_expert), block.shared_expert.config
        inter = fused.down_proj.shape[-1]
        experts = torch.nn.ModuleList([mlp_class(config, intermediate_size=inter) for _ in range(fused.num_experts)])
        for e, mlp in enumerate(experts):
            mlp.gate_proj.weight.data = fused.gate_up_proj.data[e, :inter].clone()
            mlp.up_proj.weight.data = fused.gate_up_proj.data[e, inter:].clone()
            mlp.down_proj.weight.data = fused.down_proj.data[e].clone()
        block.experts = experts


def write_ct(src: Path, folder: Path) -> Path:
    """`src` (bf16) as llm-compressor writes Qwen3.5 in ``nvfp4-pack-quantized`` (module docstring)."""
    from compressed_tensors.quantization.utils.helpers import generate_gparam
    from compressed_tensors.utils.mtp import save_mtp_tensors_to_checkpoint

    config, quantized = ct_quant_config(src)
    input_scale = generate_gparam(torch.tensor(-ACTIVATION_AMAX), torch.tensor(ACTIVATION_AMAX))

    def quantize(prefix: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        return {**C.nvfp4_ct_quantize(prefix, weight), f"{prefix}.input_global_scale": input_scale.clone()}

    _write_quantized(src, folder, quantized, quantize, {"quantization_config": config}, keep=lambda n: "mtp." not in n)
    save_mtp_tensors_to_checkpoint(source_model=str(src), dest_dir=str(folder))
    return folder


# -------------------------------------------------------------------------------------------------------- ModelOpt
def _layers(src: Path) -> tuple[str, int]:
    """The decoder layers' name prefix and count: Qwen3.5 nests the language model (text_config), Qwen3-Next not."""
    config = json.loads((src / "config.json").read_text())
    if "text_config" in config:
        return "model.language_model.layers.", config["text_config"]["num_hidden_layers"]
    return "model.layers.", config["num_hidden_layers"]


def modelopt_quantized(name: str, layers_prefix: str) -> bool:
    """A Linear weight ModelOpt's default NVFP4 config quantizes in the language model: every 2-D weight but the
    embeddings, lm_head, the router, shared_expert_gate (the conv1d is 3-D); the vision tower and MTP not exported
    quantized."""
    if not name.startswith(layers_prefix) or not name.endswith(".weight"):
        return False
    return not name.endswith(("norm.weight", "mlp.gate.weight", "shared_expert_gate.weight", "conv1d.weight"))


def modelopt_exclude_modules(src: Path) -> list[str]:
    """The exclude list as ModelOpt writes it: lm_head and each layer's excluded Linear by name, then the parts left
    unquantized by prefix."""
    prefix, layers = _layers(src)
    per_layer = [f"{prefix}{L}.mlp.{m}" for L in range(layers) for m in ("gate", "shared_expert_gate")]
    return ["lm_head", *per_layer, "model.visual*", "mtp*"]


def modelopt_hf_quant_config(src: Path) -> dict[str, Any]:
    return {"producer": {"name": "modelopt", "version": "0.37.0"}, "quantization": {
        "quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
        "exclude_modules": modelopt_exclude_modules(src)}}


def modelopt_config_json_form(hf_quant_config: dict[str, Any]) -> dict[str, Any]:
    """What newer ModelOpt also writes into config.json (modelopt/torch/export/convert_hf_config.py
    convert_hf_quant_config_format): the exclude list as ``ignore``, ``quant_method: modelopt``."""
    q = hf_quant_config["quantization"]
    group = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": q["group_size"]}
    return {"config_groups": {"group_0": {"input_activations": group, "weights": group, "targets": ["Linear"]}},
            "ignore": q["exclude_modules"], "quant_algo": q["quant_algo"], "producer": hf_quant_config["producer"],
            "quant_method": "modelopt"}


def write_modelopt(src: Path, folder: Path, config_json_form: bool = False) -> Path:
    """`src` (bf16) as ModelOpt exports Qwen3.5 in NVFP4 (module docstring); `config_json_form`: also the config.json
    ``quantization_config`` newer ModelOpt writes beside hf_quant_config.json."""
    input_scale = torch.tensor(ACTIVATION_AMAX / (6.0 * 448.0), dtype=torch.float32)

    def quantize(prefix: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        return {**C.nvfp4_modelopt_quantize(prefix, weight), f"{prefix}.input_scale": input_scale.clone()}

    hf_quant = modelopt_hf_quant_config(src)
    prefix, _ = _layers(src)
    quantized = {n.removesuffix(".weight") for n in load_file(src / "model.safetensors") if modelopt_quantized(n, prefix)}
    extra = {"quantization_config": modelopt_config_json_form(hf_quant)} if config_json_form else {}
    _write_quantized(src, folder, quantized, quantize, extra, keep=lambda n: True)
    (folder / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=4))
    return folder


# --------------------------------------------------------------------------------------------------------- shared
def _write_quantized(src: Path, folder: Path, quantized: set[str], quantize: C.Quantizer, config_fields: dict[str, Any],
                     keep: Callable[[str], bool]) -> None:
    state = load_file(src / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module in quantized:
            out.update(quantize(module, tensor))
        elif keep(name):
            out[name] = tensor
    assert quantized <= {n.removesuffix(".weight") for n in state}, "a quantized module without a weight"
    folder.mkdir(parents=True, exist_ok=True)
    save_file(out, folder / "model.safetensors", metadata={"format": "pt"})
    config = {**json.loads((src / "config.json").read_text()), **config_fields}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if (src / "generation_config.json").is_file():
        shutil.copy(src / "generation_config.json", folder / "generation_config.json")


def float32_reference(src: Path, quantized: Path, folder: Path) -> Path:
    """`src` with each quantized Linear replaced by its stored bytes dequantized in float32 by the producer's own
    decoder (compressed-tensors' decompressor; torchao's NVFP4Tensor for ModelOpt, in float32), written under the
    bf16 names so transformers loads it as an ordinary float32 model."""
    from safetensors import safe_open

    stored: dict[str, torch.Tensor] = {}
    for shard in quantized.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            stored |= {k: f.get_tensor(k) for k in f.keys()}
    state = {k: v.float() for k, v in load_file(src / "model.safetensors").items()}
    for name in list(state):
        prefix = name.removesuffix(".weight")
        if f"{prefix}.weight_packed" in stored:
            state[name] = _ct_float32(prefix, stored)
        elif f"{prefix}.weight_scale_2" in stored:
            state[name] = _modelopt_float32(prefix, stored)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    for fields in (config, config.get("text_config", {})):
        fields.pop("torch_dtype", None)
        fields["dtype"] = "float32"
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _ct_float32(prefix: str, stored: dict[str, torch.Tensor]) -> torch.Tensor:
    """compressed-tensors' decompressor steps (NVFP4PackedCompressor.decompress) with float32 as the dtype it
    unpacks into (its default, bfloat16, would round the reference)."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    packed = stored[f"{prefix}.weight_packed"]
    rows, half = packed.shape
    codes = unpack_fp4_from_uint8(packed, rows, half * 2, dtype=torch.float32)
    return dequantize(x_q=codes, scale=stored[f"{prefix}.weight_scale"].to(torch.float32),
                      args=C._nvfp4_scheme().weights, global_scale=stored[f"{prefix}.weight_global_scale"],
                      dtype=torch.float32)


def _modelopt_float32(prefix: str, stored: dict[str, torch.Tensor]) -> torch.Tensor:
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor

    tensor = NVFP4Tensor(stored[f"{prefix}.weight"], stored[f"{prefix}.weight_scale"], 16, torch.float32,
                         per_tensor_scale=stored[f"{prefix}.weight_scale_2"])
    return tensor.dequantize(torch.float32)
