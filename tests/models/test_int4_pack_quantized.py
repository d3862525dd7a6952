"""compressed-tensors ``pack-quantized`` INT4 experts: Kimi-K2-Thinking's W4A16 (int4 symmetric, one bf16 scale per
32 inputs, ``weight_packed`` int32 of 8 codes, ``weight_shape``), formats/int4.py + ``int4-ct`` in formats/catalog.py.

The checkpoints: a tiny DeepseekV3ForCausalLM (Kimi-K2's class), a tiny Kimi-K2.5 (its multimodal class: names under
language_model.*, INT4 experts as it ships) and a tiny Qwen3-MoE, written by transformers in bf16
(correction biases randomized), whose routed experts are quantized by compressed-tensors' OWN code (`calculate_qparams`
for the scales, `PackedQuantizationCompressor.compress` for the stored tensors) with Kimi-K2-Thinking's scheme, and
its ``quantization_config`` written by compressed-tensors' `QuantizationConfig` with Kimi-K2-Thinking's ignore list
(attention, shared experts, the dense MLPs and lm_head stay bf16; the router is not a Linear in DeepSeek-V3, Qwen3's
``mlp.gate`` is ignored as llm-compressor's recipes ignore it).

- The engine's dequantized experts equal compressed-tensors' decompression bit for bit (bf16: its `decompress`;
  float32: its `dequantize` with the scale in float32).
- fp32: transformers' greedy tokens and logprobs within 1e-4 on the weights compressed-tensors decodes.
- bf16, default settings: 3 expert slots == resident bit for bit; a miss reads exactly one expert's stored bytes.
- `moeserve plan` / `inspect` from config.json alone print the checkpoint's lines.
- Variants not read (asymmetric, int8, activation ordering, channel strategy, an odd group size) are refused in one
  line naming the field.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeserve.bench.checkpoints import write_tiny_checkpoint
from moeserve.errors import UnsupportedModelError
from moeserve.formats import load_quant_scheme
from tests.models import exactness as X
from tests.models.test_deepseek_v3 import write_tiny as write_deepseek
from tests.models.test_deepseek_v3 import write_tiny_kimi_k25

GROUP_SIZE = 32
# Kimi-K2-Thinking's config.json quantization_config "ignore" (moonshotai/Kimi-K2-Thinking)
KIMI_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]
# Kimi-K2.5's, in its checkpoint's module names (the language model under language_model.; its published list was not
# available offline): compressed-tensors matches a plain name whole, so "lm_head" alone would not name its head
KIMI_K25_IGNORE = ["language_model.lm_head", *KIMI_IGNORE[1:]]
IGNORE = {"deepseek_v3": KIMI_IGNORE, "kimi_k25": KIMI_K25_IGNORE, "qwen3_moe": [*KIMI_IGNORE, "re:.*mlp.gate$"]}
ARCHS = tuple(IGNORE)


def kimi_scheme() -> Any:
    """Kimi-K2-Thinking's weights args: int4, symmetric, group strategy, group size 32, static (W4A16)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=GROUP_SIZE, symmetric=True,
                            dynamic=False)
    return QuantizationScheme(targets=["Linear"], weights=args)


def kimi_quant_config(arch: str) -> dict[str, Any]:
    """The quantization_config compressed-tensors writes for the scheme and ignore list."""
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    config = QuantizationConfig(config_groups={"group_0": kimi_scheme()}, format="pack-quantized",
                                ignore=IGNORE[arch], quantization_status=QuantizationStatus.COMPRESSED)
    return config.model_dump(mode="json")


def is_quantized(name: str, arch: str) -> bool:
    """A Linear weight compressed-tensors quantizes: a `*_proj` weight of a layer, not ignored (DeepSeek-V3's router
    is no Linear; Qwen3's, ``mlp.gate``, is ignored)."""
    from compressed_tensors.utils.match import match_name

    module = name.removesuffix(".weight")
    linear = name.endswith("_proj.weight") and name.startswith(("model.layers.", "language_model.model.layers."))
    return linear and not any(match_name(module, target) for target in IGNORE[arch])


def ct_compress(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors' own quantizer: min/max scales per group, then PackedQuantizationCompressor.compress."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    scheme = kimi_scheme()
    groups = weight.unflatten(-1, (-1, GROUP_SIZE))
    scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
    state = {"weight": weight, "weight_scale": scale, "weight_zero_point": zero_point}
    return dict(PackedQuantizationCompressor.compress(state, scheme))


def ct_decompress(stored: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """compressed-tensors' decoding of one Linear: `decompress` (bf16, the scale's dtype), or its steps with the
    scale in float32 (`dequantize`, as `decompress` does it)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    if dtype == stored["weight_scale"].dtype:
        return PackedQuantizationCompressor.decompress(dict(stored), kimi_scheme())["weight"]
    codes = unpack_from_int32(stored["weight_packed"], 4, stored["weight_shape"])
    return dequantize(x_q=codes, scale=stored["weight_scale"].to(dtype), args=kimi_scheme().weights, dtype=dtype)


def write_int4(src: Path, folder: Path, arch: str) -> Path:
    state = load_file(src / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if is_quantized(name, arch):
            prefix = name.removesuffix(".weight")
            out |= {f"{prefix}.{role}": value for role, value in ct_compress(tensor).items()}
        else:
            out[name] = tensor
    folder.mkdir(parents=True)
    save_file(out, folder / "model.safetensors", metadata={"format": "pt"})
    config = {**json.loads((src / "config.json").read_text()), "quantization_config": kimi_quant_config(arch)}
    (folder / "config.json").write_text(json.dumps(config))
    if (src / "generation_config.json").is_file():
        shutil.copy(src / "generation_config.json", folder / "generation_config.json")
    return folder


def float32_reference(src: Path, quantized: Path, folder: Path) -> Path:
    """`src` in float32 with each quantized Linear replaced by compressed-tensors' float32 decoding of its bytes."""
    stored = load_file(quantized / "model.safetensors")
    state = {k: v.float() for k, v in load_file(src / "model.safetensors").items()}
    for name in list(state):
        prefix = name.removesuffix(".weight")
        if f"{prefix}.weight_packed" in stored:
            roles = {r: stored[f"{prefix}.{r}"] for r in ("weight_packed", "weight_scale", "weight_shape")}
            state[name] = ct_decompress(roles, torch.float32)
    folder.mkdir(parents=True)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config.pop("torch_dtype", None)
    config["dtype"] = "float32"
    (folder / "config.json").write_text(json.dumps(config))
    return folder


WRITERS = {"deepseek_v3": lambda folder: write_deepseek(folder, torch.bfloat16),
           "kimi_k25": lambda folder: write_tiny_kimi_k25(folder, torch.bfloat16),
           "qwen3_moe": lambda folder: write_tiny_checkpoint(folder, "qwen3_moe", "bfloat16")}


class Folders(dict):
    """arch -> its int4 checkpoint, `arch-bf16` -> the bf16 one it was made from: written on first use."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    def __missing__(self, key: str) -> Path:
        arch = key.removesuffix("-bf16")
        src = self[f"{arch}-bf16"] = WRITERS[arch](self.root / f"{arch}-bf16")
        self[arch] = write_int4(src, self.root / arch, arch)
        return self[key]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return Folders(tmp_path_factory.mktemp("int4_pack_quantized"))


def prompts(seed: int = 0) -> list[list[int]]:
    return X.random_prompts(seed, (40, 5, 17))


@pytest.mark.parametrize("arch", ARCHS)
def test_experts_are_int4_and_decode_as_compressed_tensors_does(folders: dict[str, Path], arch: str) -> None:
    """Only the routed experts are int4 (Kimi's ignore list); each decodes to compressed-tensors' bits, bf16 and fp32."""
    scheme = load_quant_scheme(folders[arch])
    fmt = scheme.weight_format
    assert fmt.name == "int4-ct"
    stored = load_file(folders[arch] / "model.safetensors")
    packed = {n.removesuffix(".weight_packed") for n in stored if n.endswith(".weight_packed")}
    dense = {n.removesuffix(".weight") for n in stored if n.endswith("_proj.weight")}
    assert packed and all(".mlp.experts." in m and scheme.is_quantized(m) for m in packed)
    assert dense and not any(scheme.is_quantized(m) for m in dense)
    assert any("self_attn" in m for m in dense) and any("mlp.gate_proj" in m for m in dense)  # attention, dense MLP
    for module in sorted(packed)[:12]:
        roles = fmt.select(module, stored)
        for dtype in (torch.bfloat16, torch.float32):
            out = torch.empty(fmt.dequantized_shape(roles), dtype=dtype)
            fmt.dequantize(roles, out)
            assert torch.equal(out, ct_decompress(roles, dtype)), (module, dtype)


def test_the_nibble_is_offset_binary_as_compressed_tensors_packs_it() -> None:
    """Every code -8..7 in every position of a word: value = nibble - 8 (pack_to_int32 adds 8), times the scale."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from moeserve.formats.int4 import dequantize_int4_packed

    codes = torch.arange(-8, 8, dtype=torch.int8).repeat(4, 4)  # [4, 64]
    codes[1] = codes[1].flip(0)
    scale = torch.tensor([[0.5, -3.0], [1.0, 2.0], [0.25, 4.0], [8.0, 0.125]], dtype=torch.bfloat16)
    out = torch.empty(4, 64, dtype=torch.float32)
    dequantize_int4_packed(pack_to_int32(codes, 4), scale, out, GROUP_SIZE)
    assert torch.equal(out, codes.float() * scale.float().repeat_interleave(GROUP_SIZE, 1))


@pytest.mark.parametrize("arch", ARCHS)
def test_matches_transformers_on_the_decompressed_weights(folders: dict[str, Path], arch: str,
                                                         tmp_path: Path) -> None:
    """fp32: transformers' greedy tokens, logprobs within 1e-4, on compressed-tensors' float32 decoding."""
    from transformers import AutoModelForCausalLM, Kimi_K25ForConditionalGeneration

    reference = float32_reference(folders[f"{arch}-bf16"], folders[arch], tmp_path / "ref")
    model_class = Kimi_K25ForConditionalGeneration if arch == "kimi_k25" else AutoModelForCausalLM  # multimodal
    model = model_class.from_pretrained(reference, dtype=torch.float32).eval()
    choices = X.assert_matches_transformers(folders[arch], model, prompts())
    assert "experts stored as int4-ct in every tier" in choices["experts"]


@pytest.mark.parametrize("arch", ARCHS)
def test_offloaded_equals_resident_in_bf16(folders: dict[str, Path], arch: str) -> None:
    """Default settings (bf16, the checkpoint's dtype): 3 expert slots give the resident run's bits, every step."""
    X.assert_offloaded_equals_resident(folders[arch], prompts(1))


def test_a_miss_reads_one_experts_stored_bytes(folders: dict[str, Path]) -> None:
    """One slot: every miss reads exactly the stored int4 tensors of one expert (packed codes, scales, shapes)."""
    stored = X.assert_a_miss_reads_one_expert(folders["deepseek_v3"], prompts(2), "model.layers.1.mlp.experts.0.")
    h, i = 64, 32  # TINY hidden_size, moe_intermediate_size
    assert stored == 3 * (h * i // 2 + h * i // GROUP_SIZE * 2 + 16)  # int4 codes + bf16 scales + weight_shape


@pytest.mark.parametrize("arch", ARCHS)
def test_plan_and_inspect_from_the_config_alone(folders: dict[str, Path], arch: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture) -> None:
    from tests.cli.test_config_only import plan_and_inspect_lines

    got, want, skipped = plan_and_inspect_lines(folders[arch], tmp_path / "bare", capsys)
    want = [line for line in want if not (skipped and line.startswith("not served:"))]
    assert got[0] == "exit 0" and got == want
    assert any("int4-ct" in line and "experts.*.down_proj" in line for line in got)


# Kimi-K2-Thinking's published config.json quantization_config, verbatim
KIMI_K2_THINKING = {
    "config_groups": {"group_0": {"input_activations": None, "output_activations": None, "targets": ["Linear"],
                                  "weights": {"actorder": None, "block_structure": None, "dynamic": False,
                                              "group_size": 32, "num_bits": 4, "observer": "minmax",
                                              "observer_kwargs": {}, "strategy": "group", "symmetric": True,
                                              "type": "int"}}},
    "format": "pack-quantized", "ignore": KIMI_IGNORE, "kv_cache_scheme": None, "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}  # fmt: skip


def test_kimi_k2_thinking_is_sized_from_its_published_config(tmp_path: Path) -> None:
    """Kimi-K2's config.json with Kimi-K2-Thinking's quantization_config: every routed expert int4 (codes, a bf16 scale
    per 32, the shape), everything else bf16 (the routers and correction biases float32)."""
    from moeserve.models.config_only import config_only_checkpoint
    from tests.models.test_deepseek_v3 import CONFIGS

    config = {**json.loads((CONFIGS / "Kimi-K2.json").read_text()), "quantization_config": KIMI_K2_THINKING}
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = config_only_checkpoint(tmp_path / "config.json").tensors
    h, i = config["hidden_size"], config["moe_intermediate_size"]
    expert = {n: r for n, r in tensors.items() if n.startswith("model.layers.1.mlp.experts.0.")}
    assert {n.rsplit(".", 1)[1]: r.dtype_code for n, r in expert.items()} == {
        "weight_packed": "I32", "weight_scale": "BF16", "weight_shape": "I64"}
    assert sum(r.nbytes for r in expert.values()) == 3 * (h * i // 2 + h * i // GROUP_SIZE * 2 + 16)
    others = {r.dtype_code for n, r in tensors.items() if ".mlp.experts." not in n}
    assert others == {"BF16", "F32"} and all(".mlp.gate." in n for n, r in tensors.items() if r.dtype_code == "F32")


REFUSED = {  # weights arg -> a value Kimi-K2-Thinking's scheme does not have
    "symmetric": False,  # zero points (W4A16_ASYM)
    "num_bits": 8,  # int8 pack-quantized (W8A16)
    "actorder": "group",  # activation ordering: weight_g_idx
    "strategy": "channel",
    "group_size": 33,
}


@pytest.mark.parametrize("arg", REFUSED)
def test_variants_not_read_are_refused_in_one_line(folders: dict[str, Path], arg: str, tmp_path: Path) -> None:
    folder = tmp_path / "variant"
    folder.mkdir()
    config = json.loads((folders["deepseek_v3"] / "config.json").read_text())
    config = copy.deepcopy(config)
    config["quantization_config"]["config_groups"]["group_0"]["weights"][arg] = REFUSED[arg]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=rf"weights\.{arg}=") as err:
        load_quant_scheme(folder)
    assert "\n" not in str(err.value) and "config.json" in str(err.value)
