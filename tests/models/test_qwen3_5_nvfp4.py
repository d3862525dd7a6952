"""Qwen3.5-35B-A3B's NVFP4 variant (Qwen3_5MoeForConditionalGeneration) in the two layouts its published NVFP4
checkpoints use (tests/models/qwen3_5_nvfp4_checkpoints.py: compressed-tensors as llm-compressor's Qwen3.5 recipe
writes it, and NVIDIA ModelOpt, with hf_quant_config.json alone or with the config.json form newer ModelOpt adds).

- Which Linears each producer quantized is what the engine reads as quantized (the ModelOpt config.json form's
  ``ignore`` list included); experts stay NVFP4 in the store, dense NVFP4 Linears (attention, shared expert, and
  for ModelOpt the Gated DeltaNet projections) are dequantized at load; the vision tower, mtp.* and the activation
  scales are never loaded, each logged.
- fp32: transformers' greedy tokens and logprobs within 1e-4 on the same bytes dequantized in float32 by the
  producers' own decoders (compressed-tensors, torchao).
- bf16, default settings: 3 expert slots == resident bit for bit; a miss reads exactly one expert's stored bytes.
- `moeserve plan` and `inspect` from config.json (+ hf_quant_config.json) alone print the checkpoint's lines.
- A layout not read (experts fused in one NVFP4 tensor, ModelOpt MIXED_PRECISION) is refused in one line.
- Qwen3-Next (the same layer kinds) in both layouts: fp32 vs transformers, bf16 offloaded == resident.
- Real dimensions (Qwen3.5-35B-A3B truncated to 3 Gated DeltaNet + 1 full attention layer): loads, offloaded ==
  resident (slow).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeserve import LLM
from moeserve.errors import UnsupportedModelError
from moeserve.formats import load_quant_scheme
from tests.fixtures import qwen3_5_nvfp4 as Q
from tests.models import exactness as X
from tests.models.test_qwen3_next import TINY_QWEN35_TEXT, long_prompts

VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
LAYOUTS = ("ct", "modelopt", "modelopt-config-json")
FORMAT = {"ct": "nvfp4-ct", "modelopt": "nvfp4-modelopt", "modelopt-config-json": "nvfp4-modelopt"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen35_nvfp4")
    src = Q.write_qwen35(root / "bf16", TINY_QWEN35_TEXT, VISION, torch.bfloat16)
    return {"bf16": src, "ct": Q.write_ct(src, root / "ct"), "modelopt": Q.write_modelopt(src, root / "modelopt"),
            "modelopt-config-json": Q.write_modelopt(src, root / "modelopt-cj", config_json_form=True)}


def stored_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in folder.glob("*.safetensors"):
        out |= load_file(shard)
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_engine_reads_as_quantized_what_the_producer_quantized(folders: dict[str, Path], layout: str) -> None:
    scheme = load_quant_scheme(folders[layout])
    stored = stored_tensors(folders[layout])
    weight_role = scheme.weight_format.roles[0]
    quantized = {n.removesuffix("." + weight_role) for n, t in stored.items()
                 if n.endswith("." + weight_role) and t.dtype == torch.uint8}
    dense = {n.removesuffix(".weight") for n, t in stored.items() if n.endswith(".weight") and t.dim() == 2
             and n.startswith(("model.language_model.layers.", "lm_head")) and t.dtype == torch.bfloat16}
    assert quantized and dense and all(scheme.is_quantized(m) for m in quantized)
    assert not any(scheme.is_quantized(m) for m in dense), [m for m in dense if scheme.is_quantized(m)]
    # what each producer quantizes beside the experts: attention and the shared expert; ModelOpt the linear_attn too
    assert "model.language_model.layers.3.self_attn.q_proj" in quantized
    assert "model.language_model.layers.0.mlp.shared_expert.down_proj" in quantized
    assert ("model.language_model.layers.0.linear_attn.in_proj_qkv" in quantized) == layout.startswith("modelopt")
    assert {"lm_head", "model.language_model.layers.0.mlp.gate",
            "model.language_model.layers.0.mlp.shared_expert_gate"} <= dense


@pytest.mark.parametrize("layout", ["ct", "modelopt"])
def test_matches_transformers_on_the_dequantized_bytes(folders: dict[str, Path], layout: str,
                                                      tmp_path: Path) -> None:
    """fp32: greedy tokens equal, logprobs within 1e-4 of transformers' model of the producer-decoded weights."""
    from transformers import Qwen3_5MoeForConditionalGeneration

    reference = Q.float32_reference(folders["bf16"], folders[layout], tmp_path / "ref")
    model = Qwen3_5MoeForConditionalGeneration.from_pretrained(reference, dtype=torch.float32).eval()
    choices = X.assert_matches_transformers(folders[layout], model, long_prompts(4))
    assert f"experts stored as {FORMAT[layout]} in every tier" in choices["experts"]
    assert "the vision tower" in choices["not loaded: model.visual.*"]
    assert "(3 tensors" in choices["not loaded: mtp.*"]
    scales = choices["not loaded: activation scales"]
    roles = "input_global_scale" if layout == "ct" else "input_scale"
    assert re.match(rf"\d+ tensors \({roles}\) for quantizing the activations to {FORMAT[layout]}", scales), scales


@pytest.mark.parametrize("layout", ["ct", "modelopt"])
def test_offloaded_equals_resident_in_bf16(folders: dict[str, Path], layout: str) -> None:
    """Default settings (bf16, the checkpoint's dtype): 3 expert slots give the resident run's bits."""
    X.assert_offloaded_equals_resident(folders[layout], long_prompts(3))


def test_a_miss_reads_one_experts_stored_bytes(folders: dict[str, Path]) -> None:
    """One slot: every miss reads exactly the stored NVFP4 tensors of one expert (no activation scale, no bf16 copy)."""
    stored = X.assert_a_miss_reads_one_expert(folders["ct"], long_prompts(5)[1:],
                                              "model.language_model.layers.1.mlp.experts.0.", ("input_global_scale",))
    h, i = TINY_QWEN35_TEXT["hidden_size"], TINY_QWEN35_TEXT["moe_intermediate_size"]
    assert stored < 0.3 * 3 * h * i * 2  # gate, up, down in bf16


@pytest.mark.parametrize("layout", LAYOUTS)
def test_plan_and_inspect_from_the_config_alone(folders: dict[str, Path], layout: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture) -> None:
    from tests.cli.test_config_only import plan_and_inspect_lines

    got, want, skipped = plan_and_inspect_lines(folders[layout], tmp_path / "bare", capsys)
    unserved = [line for line in want if line.startswith("not served:")]  # the vision tower, mtp.*, input scales
    assert len(unserved) == 1 and f"{len(skipped)} tensors" in unserved[0]
    want.remove(unserved[0])
    assert got[0] == "exit 0" and got == want
    assert any(FORMAT[layout] in line and "experts.*.down_proj" in line for line in got)


def test_experts_fused_in_one_nvfp4_tensor_are_refused_in_one_line(folders: dict[str, Path], tmp_path: Path) -> None:
    folder = shutil.copytree(folders["modelopt"], tmp_path / "fused")
    state = load_file(folder / "model.safetensors")
    per_expert = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(\w+_proj\.\w+)$")
    fused: dict[str, dict[int, torch.Tensor]] = {}
    for name in list(state):
        if m := per_expert.match(name):
            fused.setdefault(f"{m[1]}.{m[3]}", {})[int(m[2])] = state.pop(name)
    state |= {name: torch.stack([d[e] for e in sorted(d)]) for name, d in fused.items()}
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match=r"stored fused .* one Linear per expert") as err:
        LLM(str(folder), skip_tokenizer_init=True)
    assert "\n" not in str(err.value)


def test_the_config_json_form_of_modelopt_is_read_like_hf_quant_config(folders: dict[str, Path]) -> None:
    """Newer ModelOpt's config.json quantization_config: the exclude list under 'ignore', the group size per
    config group (a size other than 16 refused, as in hf_quant_config.json)."""
    from moeserve.formats import parse_quant_config

    hf_quant = json.loads((folders["modelopt"] / "hf_quant_config.json").read_text())
    flat = Q.modelopt_config_json_form(hf_quant)
    for scheme in (parse_quant_config({"quant_method": "modelopt", **hf_quant}), parse_quant_config(flat)):
        assert scheme.excluded.patterns[-2:] == ("model.visual*", "mtp*") and not scheme.is_quantized("lm_head")
    flat["config_groups"]["group_0"]["weights"]["group_size"] = 32
    with pytest.raises(UnsupportedModelError, match="modelopt quant_algo 'NVFP4' with group_size 16, 32"):
        parse_quant_config(flat)


def test_modelopt_mixed_precision_is_refused_in_one_line(folders: dict[str, Path], tmp_path: Path) -> None:
    """NVIDIA's later Qwen3.5/3.6 NVFP4 exports mix NVFP4 and FP8 layers (quant_algo MIXED_PRECISION)."""
    folder = shutil.copytree(folders["modelopt"], tmp_path / "mixed")
    config = json.loads((folder / "hf_quant_config.json").read_text())
    config["quantization"]["quant_algo"] = "MIXED_PRECISION"
    (folder / "hf_quant_config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="quant_algo 'MIXED_PRECISION'.*hf_quant_config.json|"
                                                    "hf_quant_config.json.*quant_algo 'MIXED_PRECISION'") as err:
        LLM(str(folder), skip_tokenizer_init=True)
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------------------------------------------ Qwen3-Next
@pytest.fixture(scope="module")
def next_folders(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Qwen3-Next (the same layer kinds, no vision tower) in both layouts: llm-compressor's qwen3_next_example.py
    recipe, and ModelOpt as nvidia/Qwen3-Next-80B-A3B-*-NVFP4 ship it."""
    src = tiny_checkpoint("qwen3_next", dtype="bfloat16")  # shared by the session: only read here
    root = tmp_path_factory.mktemp("qwen3_next_nvfp4")
    return {"bf16": src, "ct": Q.write_ct(src, root / "ct"), "modelopt": Q.write_modelopt(src, root / "modelopt")}


@pytest.mark.parametrize("layout", ["ct", "modelopt"])
def test_qwen3_next_nvfp4_matches_transformers(next_folders: dict[str, Path], layout: str, tmp_path: Path) -> None:
    from tests.engine.test_parity_transformers import hf_model

    reference = Q.float32_reference(next_folders["bf16"], next_folders[layout], tmp_path / "ref")
    choices = X.assert_matches_transformers(next_folders[layout], hf_model(reference, torch.float32), long_prompts(4))
    assert f"experts stored as {FORMAT[layout]} in every tier" in choices["experts"]
    assert "not loaded: activation scales" in choices


@pytest.mark.parametrize("layout", ["ct", "modelopt"])
def test_qwen3_next_nvfp4_offloaded_equals_resident_in_bf16(next_folders: dict[str, Path], layout: str) -> None:
    X.assert_offloaded_equals_resident(next_folders[layout], long_prompts(3))


# -------------------------------------------------------------------------------------------------- real dimensions
@pytest.mark.slow
def test_real_dims_loads_and_offloaded_equals_resident(
        tmp_path: Path, checkpoint_once: Callable[[str, Callable[[Path], Path]], Path]) -> None:
    """Qwen3.5-35B-A3B's published text_config truncated to 4 layers (3 Gated DeltaNet + 1 gated full attention, 12
    of its 256 experts), quantized as llm-compressor writes it: bf16 default settings, 3 expert slots == resident,
    experts NVFP4 in every tier; the test's peak RSS stays under 6 GiB. The bf16 checkpoint is the real-dims
    exactness module's (tests/models/test_real_dims_exactness.py SHARED): written once per session."""
    from moeserve.memory.rss import current_rss_bytes, peak_rss_bytes
    from tests.fixtures.real_dims import BUILDERS

    peak_reset = _reset_peak_rss()
    src = checkpoint_once("real_dims-Qwen3.5-35B-A3B", BUILDERS["Qwen3.5-35B-A3B"])
    folder = Q.write_ct(src, tmp_path / "nvfp4")
    prompts = [X.random_prompts(11, (90,), vocab=4096)[0], [11, 5, 77]]
    # a fixed need (~0.9 GiB) on top of this process's RSS: the split charges that RSS, and free memory varies
    settings = {"memory_gb": 2 + current_rss_bytes() / 2**30}
    resident = X.run_together(folder, prompts, 4, **settings)
    assert "experts stored as nvfp4-ct in every tier" in resident.choices["experts"]
    X.assert_offloaded_equals_resident(folder, prompts, resident, steps=4, **settings)
    if peak_reset:  # else the process's peak may be an earlier test's
        assert peak_rss_bytes() < 6 * 2**30, f"peak RSS {peak_rss_bytes() / 2**30:.2f} GiB"


def _reset_peak_rss() -> bool:
    """Reset this process's peak RSS (VmHWM) to its current RSS (Linux: /proc/self/clear_refs "5")."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False
