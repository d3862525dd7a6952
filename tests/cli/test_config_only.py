"""`moeserve plan` and `moeserve inspect` from config.json alone (models/config_only.py) print the very lines they
print with the weights: every supported architecture, tiny checkpoints transformers writes, in bf16 and in each
quantized format the tests can write. Compared exactly (no rounding allowed), after the tensor map built from the
config is checked against the real safetensors headers, name by name (dtype and shape)."""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from moeserve.bench.checkpoints import write_tiny_checkpoint
from moeserve.checkpoint.folder import open_checkpoint
from moeserve.checkpoint.safetensors_file import DTYPES
from moeserve.cli import main
from moeserve.formats.catalog import FORMATS, create_format
from moeserve.models.config_only import EXPERT_TENSORS, config_only_checkpoint, parameter_counts
from moeserve.models.experts.plans import EXPERT_PLANNERS
from moeserve.models.registry import NOT_YET_SERVED, get_architecture
from moeserve.models.validate import is_skipped
from tests.fixtures import checkpoints as C
from tests.fixtures.deepseek_v4 import write_tiny_deepseek_v4, write_tiny_shipped
from tests.fixtures.gemma4 import write_tiny_gemma4, write_tiny_gemma4_vl
from tests.fixtures.nemotron_h import TINY, TINY_PATTERN, randomize_mamba
from tests.fixtures.qwen4_exp import write_tiny_qwen4_exp, write_tiny_qwen4_exp_vl
from tests.models.test_deepseek_v3 import write_tiny as write_deepseek
from tests.models.test_deepseek_v3 import write_tiny_kimi_k25
from tests.models.test_deepseek_v32 import write_fp8 as write_dsa_fp8
from tests.models.test_deepseek_v32 import write_nvfp4 as write_dsa_nvfp4
from tests.models.test_deepseek_v32 import write_tiny as write_dsa
from tests.models.test_minimax_m2 import write_fp8 as write_minimax_fp8
from tests.models.test_qwen3_next import TINY_QWEN35_TEXT, write_tiny_qwen35, write_tiny_qwen35_text

REFERENCE_CONFIGS = Path(__file__).resolve().parents[1] / "data" / "reference_configs"
NEMOTRON_MODELOPT = {"producer": {"name": "modelopt"}, "quantization": {
    "quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None, "exclude_modules": ["lm_head", "*.mixer.gate"]}}


def _tiny(arch: str) -> Callable[[Path], Path]:
    return lambda folder: write_tiny_checkpoint(folder, arch, "bfloat16")


def _quantized(quantize: C.Quantizer, config: dict | None, extra: dict | None = None,
               **overrides: int) -> Callable[[Path], Path]:
    def write(folder: Path) -> Path:
        src = C.qwen3_base(folder.with_name(folder.name + "-bf16"), **overrides)
        return C.quantize_checkpoint(src, folder, quantize, config, extra)

    return write


def _qwen35_bf16(folder: Path) -> Path:
    """Qwen3.5 (vision tower included) as transformers creates it in bf16 (tests.models' writer keeps float32)."""
    from transformers import AutoModelForImageTextToText, Qwen3_5MoeConfig

    config = Qwen3_5MoeConfig(text_config=TINY_QWEN35_TEXT, vision_config=dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64))
    AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    return folder


def _deepseek_fp8(folder: Path) -> Path:
    """DeepSeek-V3 as it ships: every attention and MLP Linear FP8 with block scales (kv_a_proj_with_mqa too, which
    tests.models' quantize_checkpoint leaves bf16), router and lm_head bf16; widths leave partial edge blocks."""
    from safetensors.torch import load_file

    src = write_deepseek(folder.with_name("deepseek-src"), torch.bfloat16, intermediate_size=72, moe_intermediate_size=40)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(src / "model.safetensors").items():
        is_proj = name.endswith(".weight") and "_proj" in name.rsplit(".", 2)[-2]
        state |= C.fp8_block_quantize(name.removesuffix(".weight"), tensor) if is_proj else {name: tensor}
    return C._write(src, folder, state, C.FP8_CONFIG)


def _nemotron(folder: Path, **fields: int) -> Path:
    """Nemotron-H in bf16 as transformers creates it with a dtype (its router and correction bias kept in float32,
    as in the published checkpoints; tests.models' writer casts the whole model)."""
    from transformers import AutoModelForCausalLM, NemotronHConfig

    config = NemotronHConfig(**{"hybrid_override_pattern": TINY_PATTERN, **TINY, **fields})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    randomize_mamba(model, 0)
    model.save_pretrained(folder)
    return folder


def _kimi_remote_code(folder: Path) -> Path:
    """Kimi-K2.5 under the architecture name of its published config.json (KimiK25ForConditionalGeneration)."""
    write_tiny_kimi_k25(folder, torch.bfloat16)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["KimiK25ForConditionalGeneration"]}))
    return folder


def _nemotron_nvfp4(folder: Path) -> Path:
    src = _nemotron(folder.with_name(folder.name + "-bf16"), moe_shared_expert_intermediate_size=48)
    return C.quantize_checkpoint(src, folder, C.nvfp4_modelopt_quantize, None,
                                 {"hf_quant_config.json": NEMOTRON_MODELOPT})


# case -> writer of the full checkpoint. Every architecture in moeserve/models/archs/ (bf16), then every quantized
# format the tests write (the gpt-oss MXFP4 layout; compressed-tensors NVFP4 / MXFP4, ModelOpt NVFP4, FP8 blocks).
CASES: dict[str, Callable[[Path], Path]] = {
    **{arch: _tiny(arch) for arch in ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "glm4_moe", "qwen3_next",
                                      "minimax_m2")},
    "gpt_oss": lambda folder: C.write_gpt_oss(folder),
    "deepseek_v3": lambda folder: write_deepseek(folder, torch.bfloat16),
    "deepseek_v32": lambda folder: write_dsa(folder, "deepseek_v32", torch.bfloat16),  # + the indexer's tensors
    "glm_moe_dsa": lambda folder: write_dsa(folder, "glm_moe_dsa", torch.bfloat16),
    "qwen3_5_moe": write_tiny_qwen35,  # float32, vision tower and mtp.* tensors beside the language model
    "qwen3_5_moe-bf16": _qwen35_bf16,
    "qwen3_5_moe_text": write_tiny_qwen35_text,  # float32, an mtp.* tensor beside
    "kimi_k25": lambda folder: write_tiny_kimi_k25(folder, torch.bfloat16),  # vision tower and projector beside
    "kimi_k25-remote-code": _kimi_remote_code,
    "nemotron_h": _nemotron,
    "qwen4_exp": write_tiny_qwen4_exp,  # bf16; n-gram tables in row blocks, their int64 hash buffers beside
    "qwen4_exp-vl": write_tiny_qwen4_exp_vl,  # its vision tower beside
    "gemma4": lambda folder: write_tiny_gemma4(folder, torch.bfloat16),  # global layers of their own head shape
    "gemma4-vl": lambda folder: write_tiny_gemma4_vl(folder, torch.bfloat16),  # its vision tower beside
    "gpt_oss-mxfp4": lambda folder: C.write_gpt_oss_mxfp4(C.write_gpt_oss(folder.with_name("gpt_oss-src")), folder),
    "qwen3_moe-nvfp4-ct": _quantized(C.nvfp4_ct_quantize, C.NVFP4_CT_CONFIG),
    "qwen3_moe-nvfp4-modelopt": _quantized(C.nvfp4_modelopt_quantize, None,
                                           {"hf_quant_config.json": C.MODELOPT_HF_QUANT_CONFIG}),
    "qwen3_moe-fp8-block": _quantized(C.fp8_block_quantize, C.FP8_CONFIG, moe_intermediate_size=40,
                                      intermediate_size=72),
    "qwen3_moe-mxfp4-ct": _quantized(C.mxfp4_ct_quantize, C.MXFP4_CT_CONFIG),
    "deepseek_v3-fp8-block": _deepseek_fp8,
    "deepseek_v32-fp8-block": lambda folder: write_dsa_fp8(folder)[0],  # indexer wq_b / wk FP8, weights_proj not
    "glm_moe_dsa-nvfp4-modelopt": lambda folder: write_dsa_nvfp4(folder)[0],  # likewise in NVFP4
    "minimax_m2-fp8-block": lambda folder: write_minimax_fp8(folder)[0],  # attention and experts FP8, as shipped
    "nemotron_h-nvfp4-modelopt": _nemotron_nvfp4,
    "deepseek_v4": write_tiny_deepseek_v4,  # bf16, its norms, sinks, gate biases and hyper-connections in fp32
    "deepseek_v4-fp8-mxfp4": write_tiny_shipped,  # as DeepSeek-V4-Flash ships: E8M0-scaled FP8, MXFP4 experts
}
CONFIG_FILES = ("config.json", "hf_quant_config.json", "generation_config.json")  # what a user downloads first


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Path]]:
    """(full checkpoint, folder holding only its config files) per case, built on first use."""
    root = tmp_path_factory.mktemp("config_only")

    @functools.cache
    def make(case: str) -> tuple[Path, Path]:
        full = CASES[case](root / case)
        bare = root / f"{case}-config"
        bare.mkdir()
        for name in CONFIG_FILES:
            if (full / name).is_file():
                shutil.copy(full / name, bare / name)
        return full, bare

    return make


def test_every_expert_kind_has_its_tensor_list() -> None:
    assert set(EXPERT_TENSORS) == set(EXPERT_PLANNERS)


def test_every_registered_architecture_is_a_case(folders) -> None:
    """A new architecture in moeserve/models/archs/ must be added to CASES."""
    from moeserve.models.registry import _REGISTRY, _load_all

    _load_all()
    covered = {json.loads((folders(case)[1] / "config.json").read_text())["architectures"][0] for case in CASES}
    assert covered == set(_REGISTRY)


@pytest.mark.parametrize("case", CASES)
def test_tensor_map_equals_the_checkpoint_headers(folders, case: str) -> None:
    """Every tensor the model serves, with the dtype and shape transformers (or the quantizer) stored it in."""
    full, bare = folders(case)
    ckpt = open_checkpoint(full)
    arch = get_architecture(ckpt.config, "config.json")
    spec = arch.spec(ckpt.config, "config.json")
    served = {n: (r.dtype_code, r.shape) for n, r in ckpt.tensors.items() if not is_skipped(arch, spec, n)}
    sized = config_only_checkpoint(bare / "config.json").tensors
    assert {n: (r.dtype_code, r.shape) for n, r in sized.items()} == served
    assert all(sized[n].nbytes == ckpt.tensors[n].nbytes for n in served)
    if "quantization_config" not in ckpt.config and not (full / "hf_quant_config.json").is_file():
        # inspect's `parameters:` line counts every served element
        assert parameter_counts(arch, spec).total == sum(ckpt.tensors[n].numel for n in served)


def _lines(capsys: pytest.CaptureFixture, argv: list[str]) -> list[str]:
    """The exit status and every printed line (stdout, then stderr: a refusal too) but those naming the path."""
    capsys.readouterr()
    rc = main(argv)
    captured = capsys.readouterr()
    out = [*captured.out.splitlines(), *captured.err.splitlines()]
    return [f"exit {rc}", *(line for line in out if not line.startswith(("model:", "weights:")))]


def plan_and_inspect_lines(full: Path, bare: Path,
                           capsys: pytest.CaptureFixture) -> tuple[list[str], list[str], set[str]]:
    """For a checkpoint whose format has no case here: copy its config files into `bare`, check the tensor map from
    the config equals the served tensors' headers and `plan` prints the same lines at three budgets; return `inspect`'s
    lines from the config alone, with the weights, and the names of the tensors not loaded."""
    from moeserve.models.inventory import not_loaded
    from moeserve.models.validate import read_model

    bare.mkdir()
    for name in CONFIG_FILES:
        if (full / name).is_file():
            shutil.copy(full / name, bare / name)
    ckpt = open_checkpoint(full)
    arch, spec = read_model(ckpt)
    skipped = not_loaded(ckpt, arch, spec)
    served = {n: (r.dtype_code, r.shape) for n, r in ckpt.tensors.items() if n not in skipped}
    assert {n: (r.dtype_code, r.shape) for n, r in config_only_checkpoint(bare / "config.json").tensors.items()} == served
    flags = ["--no-probe", "--device", "cpu", "--max-model-len", "256"]
    for budget in ("0.513", "0.52", "4"):
        got = _lines(capsys, ["plan", str(bare), "--memory-gb", budget, *flags])
        assert got == _lines(capsys, ["plan", str(full), "--memory-gb", budget, *flags]), budget
    return _lines(capsys, ["inspect", str(bare)]), _lines(capsys, ["inspect", str(full)]), skipped


@pytest.mark.parametrize("case", CASES)
def test_plan_from_config_equals_plan_with_weights(folders, case: str, capsys: pytest.CaptureFixture) -> None:
    full, bare = folders(case)
    flags = ["--no-probe", "--device", "cpu", "--max-model-len", "256"]
    # the 512 MiB stated runtime leaves a few MiB for the model: refused, experts offloaded, all resident
    outcomes = set()
    for budget in ("0.505", "0.5125", "0.513", "0.514", "0.516", "0.52", "4"):
        got = _lines(capsys, ["plan", str(bare), "--memory-gb", budget, *flags])
        assert got == _lines(capsys, ["plan", str(full), "--memory-gb", budget, *flags]), budget
        outcomes.add(got[0] if got[0] != "exit 0" else next(x for x in got if x.startswith("placement:"))[:40])
    assert got[0] == "exit 0" and any(line.startswith("experts:") for line in got)
    assert any(line.startswith("sequence state:") for line in got)
    assert len(outcomes) >= 2, outcomes  # at least a refusal or an offloaded plan beside the resident one
    # a config file by its own path (any name) gives the same lines as its folder
    named = bare.with_name(bare.name + ".json")
    shutil.copy(bare / "config.json", named)
    if not (bare / "hf_quant_config.json").is_file():
        assert _lines(capsys, ["plan", str(named), "--memory-gb", "4", *flags]) == got


@pytest.mark.parametrize("case", CASES)
def test_inspect_from_config_equals_inspect_with_weights(folders, case: str, capsys: pytest.CaptureFixture) -> None:
    full, bare = folders(case)
    got, want = _lines(capsys, ["inspect", str(bare)]), _lines(capsys, ["inspect", str(full)])
    assert got[0] == "exit 0"
    if case.startswith(("qwen3_5_moe", "kimi_k25", "qwen4_exp-vl", "gemma4-vl")):  # a vision tower or mtp.* beside
        unserved = [line for line in want if line.startswith("not served:")]
        assert len(unserved) == 1 and "tensors" in unserved[0]
        want.remove(unserved[0])
    assert got == want
    assert _lines(capsys, ["inspect", str(bare / "config.json")]) == got  # the config file by its path
    assert json.loads("".join(_lines(capsys, ["inspect", str(bare), "--json"])[1:]))["bytes_expert"] > 0


def test_plan_says_it_sized_from_the_config(folders, capsys: pytest.CaptureFixture) -> None:
    _, bare = folders("qwen3_moe")
    capsys.readouterr()
    assert main(["plan", str(bare), "--no-probe", "--device", "cpu", "--memory-gb", "4"]) == 0
    assert "weights: none here; sized from config.json and the architecture spec" in capsys.readouterr().out


def test_a_config_file_of_an_unknown_architecture_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "odd.json"
    path.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 8}))
    assert main(["plan", str(path), "--no-probe", "--device", "cpu"]) == 1
    err = capsys.readouterr().err.strip()
    assert "LlamaForCausalLM" in err and "\n" not in err


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_stored_shapes_invert_dequantized_shape(name: str) -> None:
    """Format.stored_shapes is the inverse of dequantized_shape (the loader's check), for a 2-D and a stacked weight."""
    fmt = create_format(name)
    # a GGUF K-quant row holds whole 256-value blocks
    for shape in ((96, 256),) if name.startswith("gguf-") else ((96, 64), (4, 96, 64)):
        if len(shape) == 3 and name not in ("dense", "mxfp4-gpt-oss"):
            continue  # only gpt-oss stacks experts in one quantized tensor
        stored = fmt.stored_shapes(shape, "BF16")
        assert tuple(stored) == fmt.roles
        meta = {role: torch.empty(s, dtype=DTYPES[code][0], device="meta") for role, (code, s) in stored.items()}
        assert fmt.dequantized_shape(meta) == shape


def test_a_config_of_too_many_experts_is_refused_before_the_map_is_built(folders, tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture) -> None:
    """Every field within its bound, yet 4096 x 65536 experts: one line, not a map of 800M tensors."""
    config = json.loads((folders("qwen3_moe")[1] / "config.json").read_text())
    path = tmp_path / "bomb.json"
    path.write_text(json.dumps({**config, "num_hidden_layers": 4096, "num_experts": 2**16, "mlp_only_layers": []}))
    capsys.readouterr()
    assert main(["inspect", str(path)]) == 1
    err = capsys.readouterr().err.strip()
    assert "4096 MoE layers x 65536 experts" in err and "\n" not in err


@pytest.mark.parametrize("case", ["nemotron_h", "qwen3_moe", "gpt_oss"])
def test_expert_parameters_equal_the_checkpoints_expert_tensors(folders, case: str) -> None:
    # inspect's expert parameter count against the numel of the expert tensors transformers wrote (relu2 experts
    # have no gate: a per-kind formula counted 3*h*i for them)
    from moeserve.models.config_only import expert_parameters
    from moeserve.models.experts.plans import expert_plan
    from moeserve.models.inventory import expert_tensor_names

    full, _config = folders(case)
    ckpt = open_checkpoint(full)
    arch = get_architecture(ckpt.config, str(full))
    spec = arch.spec(ckpt.config, str(full))
    names = expert_tensor_names(expert_plan(ckpt, arch, spec, torch.bfloat16))
    assert names, case
    assert expert_parameters(arch, spec) == sum(ckpt.tensors[n].numel for n in names)


# Published parameter counts (billions), whether the publisher's "active" counts the embedding table, and where each
# figure comes from. Kimi-K2.5's text model is Kimi-K2's (its config.json's text_config: tests/data/reference_configs
# Kimi-K2.json under the K2.5 wrapper, INT4 experts as Kimi-K2-Thinking ships them, its ignore list in K2.5's module
# names); MiniMax-M2's config is
# transformers' MiniMaxM2Config defaults (no published config.json was found offline).
PUBLISHED_SIZES = {
    # DeepSeek-V3 technical report (arXiv:2412.19437): "671B total parameters with 37B activated for each token"
    "DeepSeek-V3": (671.0, 37.0),
    # Kimi K2 technical report (arXiv:2507.20534): "32 billion activated parameters and 1.04 trillion total"; the
    # Kimi-K2.5 model card: 1T total, 32B activated
    "Kimi-K2.5": (1040.0, 32.0),
    # MiniMax-M2 model card (huggingface.co/MiniMaxAI/MiniMax-M2): "230 billion total parameters with 10 billion
    # active parameters" (one significant digit: checked as rounding to it)
    "MiniMax-M2": (230.0, 10.0),
    # the figures issue 33 gives (no model card was found offline): GLM-5 744B total, 40B active; DeepSeek-V3.2 the
    # 671B / 37B of DeepSeek-V3, its indexer added. Configs: transformers 5.24's GlmMoeDsaConfig / DeepseekV32Config
    # defaults (their docstrings: zai-org/GLM-5, deepseek-ai/DeepSeek-V3.2-Exp). Z.ai counts GLM's active parameters
    # without the LM head too (GLM_ACTIVE_WITHOUT_HEAD)
    "GLM-5": (744.0, 40.0),
    # GLM-4.5 model card (huggingface.co/zai-org/GLM-4.5): GLM-4.5-Air, 106 billion total parameters, 12 billion active
    "GLM-4.5-Air": (106.0, 12.0),
    "DeepSeek-V3.2": (671.0, 37.0),
    # DeepSeek-V4 model card (huggingface.co/deepseek-ai/DeepSeek-V4-Flash, as issue 33 quotes it): 284B total, 13B
    # active; config: the published REAP160 derivative's (tests/data/reference_configs) with the original 256 experts
    "DeepSeek-V4-Flash": (284.0, 13.0),
}


def published_config(name: str) -> dict:
    from tests.models.test_int4_pack_quantized import KIMI_K2_THINKING, KIMI_K25_IGNORE
    from tests.models.test_minimax_m2 import PUBLISHED

    if name == "MiniMax-M2":
        return PUBLISHED
    if name == "DeepSeek-V4-Flash":
        from tests.fixtures.deepseek_v4 import published_config as v4_config

        return v4_config(256)
    if name in ("GLM-5", "DeepSeek-V3.2"):
        from tests.models.test_deepseek_v32 import published_config as dsa_config

        return dsa_config("glm_moe_dsa" if name == "GLM-5" else "deepseek_v32")
    config = {k: v for k, v in json.loads((REFERENCE_CONFIGS / f"{name.removesuffix('.5')}.json").read_text()).items()
              if not k.startswith("_")}
    if name in ("DeepSeek-V3", "GLM-4.5-Air"):
        return config
    return {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "tie_word_embeddings": False,
            "text_config": {k: v for k, v in config.items() if k not in ("architectures", "quantization_config")},
            "quantization_config": {**KIMI_K2_THINKING, "ignore": KIMI_K25_IGNORE}}


# Z.ai's "active" leaves out the LM head beside the embedding table: GLM-4.5-Air (published 106B / 12B; its
# config.json in tests/data/reference_configs) has 12.18B active without both, 12.80B with the head (6.7% over)
GLM_ACTIVE_WITHOUT_HEAD = ("GLM-5", "GLM-4.5-Air")


@pytest.mark.parametrize("name", PUBLISHED_SIZES)
def test_parameters_from_the_config_match_the_published_figures(name: str) -> None:
    """The counts `inspect` prints from a config alone (`parameter_counts`; its line is checked against the weights'
    above): total parameters within 2% of the published figure, active ones (without the embedding table, as
    DeepSeek, Moonshot and MiniMax count them; Z.ai without the LM head too) within 2%, or rounding to a one-digit
    figure."""
    config = published_config(name)
    arch = get_architecture(config, "config.json")
    counts = parameter_counts(arch, arch.spec(config, "config.json"))
    total, active = counts.total / 1e9, counts.active_without_embedding / 1e9
    if name in GLM_ACTIVE_WITHOUT_HEAD:
        active -= config["vocab_size"] * config["hidden_size"] / 1e9  # an untied head: vocab x hidden
    want_total, want_active = PUBLISHED_SIZES[name]
    assert abs(total / want_total - 1) < 0.02, (name, total)
    if name == "MiniMax-M2":  # "10 billion": one significant digit
        assert round(active) == want_active, (name, active)
    else:
        assert abs(active / want_active - 1) < 0.02, (name, active)


@pytest.mark.parametrize("name", ["GLM-5", "DeepSeek-V3.2"])
def test_sparse_attention_models_plan_for_24_and_64_gb(name: str, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    """From config.json alone, FP8 128x128 blocks as DeepSeek-V3 ships them: refused at 24 GB in one line (the dense
    weights alone are over 33 GiB), placed at 64 GB with experts in RAM and the rest read from disk."""
    path = tmp_path / "config.json"
    quantization = json.loads((REFERENCE_CONFIGS / "DeepSeek-V3.json").read_text())["quantization_config"]
    path.write_text(json.dumps({**published_config(name), "quantization_config": quantization}))
    flags = ["--device", "cpu", "--no-probe"]
    refused = _lines(capsys, ["plan", str(path), "--memory-gb", "24", *flags])
    assert refused[0] == "exit 1" and refused[1].startswith("error: does not fit: resident weights") and \
        len(refused) == 2, refused
    placed = _lines(capsys, ["plan", str(path), "--memory-gb", "64", *flags])
    placement = next(line for line in placed if line.startswith("placement:"))
    assert placed[0] == "exit 0" and int(placement.split()[1]) > 300, placement  # of 19200 / 14848 experts
    assert any(line.startswith("KV per token:") and "+ indexer key 128" in line for line in placed)


@pytest.mark.parametrize("name", sorted(NOT_YET_SERVED))
def test_architectures_not_served_yet_are_refused_saying_what_they_need(name: str, tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "config.json"
    config = json.loads((REFERENCE_CONFIGS / "DeepSeek-V4-Flash-0731-REAP160.json").read_text())
    path.write_text(json.dumps({**config, "architectures": [name]}))
    for command in ("plan", "inspect"):
        lines = _lines(capsys, [command, str(path)])
        assert lines[0] == "exit 1" and len(lines) == 2, lines
        assert f"architecture {name} is not served yet: it needs {NOT_YET_SERVED[name]}" in lines[1]
