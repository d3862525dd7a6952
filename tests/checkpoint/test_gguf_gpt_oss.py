"""gpt-oss GGUFs (llama.cpp's `gpt-oss`): MXFP4 experts as llama.cpp ships them (gate and up split, ggml's nibble
order), expert and router biases, attention sinks, the sliding window on alternate layers, YaRN, the clamped SwiGLU.

On a tiny GGUF written from a transformers checkpoint as llama.cpp's converter lays it out (tests/fixtures/
gguf_gpt_oss.py), beside the HF MXFP4 folder of the same weights (the GGUF's codes back in OpenAI's layout, the
other tensors dequantized by the gguf package):
- the config.json the GGUF implies gives the HF checkpoint's ModelSpec (sliding layers, YaRN, biases, sinks);
- fp32: moeserve's logits on the GGUF equal its logits on the HF MXFP4 folder bit for bit (kernels=torch: both
  dequantize at use), and the greedy tokens equal transformers' on that folder (log-probabilities within 1e-4);
- default settings (bf16, the C++ op reading the GGUF's blocks with gate rows then up rows): offloaded == resident;
- a file of llama.cpp's own converter (local only): moeserve's fp32 logits on it equal those on the HF MXFP4 folder
  it was converted from, bit for bit, and llama.cpp's greedy tokens on it are compared (the agreement printed).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from moeserve.checkpoint.folder import open_checkpoint
from moeserve.errors import CheckpointError
from moeserve.models.registry import get_architecture
from tests.fixtures.checkpoints import write_gpt_oss
from tests.fixtures.gguf_gpt_oss import write_gguf, write_reference
from tests.models.exactness import (
    Run,
    assert_offloaded_equals_resident,
    assert_outs_match_transformers,
    assert_same_run,
    random_prompts,
    run_together,
)

PROMPTS = random_prompts(11, (5, 9))  # longer than the sliding window (4): layer 0's window matters
STEPS = 5


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(HF checkpoint, its GGUF with MXFP4 experts and Q8_0 matrices, the HF MXFP4 folder of the GGUF's weights)."""
    root = tmp_path_factory.mktemp("gguf_gpt_oss")
    src = write_gpt_oss(root / "src", dtype="float32")
    return src, write_gguf(src, root / "gpt-oss.gguf"), write_reference(src, root / "ref")


def _spec(path: Path):
    config = open_checkpoint(path).config
    return get_architecture(config, str(path)).spec(config, str(path))


def _assert_transformers_tokens(got: Run, folder: Path) -> None:
    """fp32 greedy tokens equal transformers' on `folder`, log-probabilities within 1e-4."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert_outs_match_transformers(got.outs, hf, PROMPTS, STEPS)


def test_config_gives_the_checkpoints_spec(files) -> None:
    src, gguf, _ = files
    got = _spec(gguf)
    assert got.attention.sliding_window == (4, None) and got.attention.sinks
    assert got == dataclasses.replace(_spec(src), config_dtype="bfloat16")  # the checkpoint is float32
    ckpt = open_checkpoint(gguf)
    assert ckpt.config["quantization_config"]["tensor_types"] == {
        f"model.layers.{L}.mlp.experts.*.{p}_proj": "MXFP4" for L in range(2) for p in ("gate", "up", "down")}


def test_fp32_logits_equal_the_hf_mxfp4_folder_and_tokens_equal_transformers(files) -> None:
    _, gguf, ref = files
    got = run_together(gguf, PROMPTS, STEPS, dtype="float32", kernels="torch")
    assert_same_run(got, run_together(ref, PROMPTS, STEPS, dtype="float32", kernels="torch"), "GGUF vs HF MXFP4")
    _assert_transformers_tokens(got, ref)


def test_offloaded_equals_resident_with_experts_in_mxfp4_blocks(files) -> None:
    _, gguf, _ = files
    run = assert_offloaded_equals_resident(gguf, PROMPTS, steps=STEPS)
    assert "stored as gguf-mxfp4" in run.choices["experts"], run.choices["experts"]


def test_float_experts_give_transformers_tokens(files, tmp_path: Path) -> None:
    """Experts stored F32 (the converter's output from a bf16 checkpoint, F32 everywhere here): held in the compute
    dtype, gate rows then up rows; fp32 greedy tokens equal transformers' on the checkpoint itself."""
    src = files[0]
    gguf = write_gguf(src, tmp_path / "f32.gguf", "F32", "F32")
    got = run_together(gguf, PROMPTS, STEPS, dtype="float32", kernels="torch")
    assert "gate rows then up rows" in got.choices["experts"], got.choices["experts"]
    _assert_transformers_tokens(got, src)


def test_a_bad_sliding_window_pattern_is_one_line(tmp_path: Path) -> None:
    from moeserve.checkpoint.gguf.archs import GGUF_ARCHS

    derive = GGUF_ARCHS["gpt-oss"].derive
    assert derive is not None
    config = {"num_hidden_layers": 3, "rope_theta": 150000.0}
    derive(config, {"gpt-oss.attention.sliding_window_pattern": [True, False, True]}, {}, tmp_path / "x.gguf")
    assert config["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    with pytest.raises(CheckpointError, match="gpt-oss.attention.sliding_window_pattern") as e:
        derive(config, {"gpt-oss.attention.sliding_window_pattern": [True]}, {}, tmp_path / "x.gguf")
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_llama_cpp_converter_file_equals_the_hf_mxfp4_folder(tmp_path: Path) -> None:
    """llama.cpp's converter on an HF MXFP4 gpt-oss folder (the Qwen2 vocabulary, the harmony chat template of
    llama.cpp's models/templates): moeserve's fp32 logits on its GGUF equal those on the folder bit for bit, the
    template is the GGUF's, the tokenizer's ids equal llama.cpp's, and llama.cpp's greedy tokens are compared."""
    import json

    from moeserve.bench.real_dims import write_gpt_oss_mxfp4
    from moeserve.checkpoint.gguf.header import read_header
    from moeserve.checkpoint.gguf.tokenizer import gguf_tokenizer
    from moeserve.tokenizer import Tokenizer
    from tests.checkpoint.test_gguf_llama_cpp import LLAMA_CPP_SRC, VOCAB, _agreement, _convert
    from tests.checkpoint.test_gguf_tokenizer import SAMPLE

    template_file = LLAMA_CPP_SRC / "models" / "templates" / "openai-gpt-oss-120b.jinja"
    if not (LLAMA_CPP_SRC / "convert_hf_to_gguf.py").is_file() or not VOCAB.is_file() or not template_file.is_file():
        pytest.skip(f"llama.cpp's source is not at {LLAMA_CPP_SRC} (set LLAMA_CPP_SRC; not in CI)")
    spec, _ = gguf_tokenizer(VOCAB)
    tokens = read_header(VOCAB).metadata["tokenizer.ggml.tokens"]
    bf16 = write_gpt_oss(tmp_path / "bf16", vocab_size=len(tokens), eos_token_id=tokens.index("<|im_end|>"))
    src = write_gpt_oss_mxfp4(bf16, tmp_path / "mxfp4")
    template = template_file.read_text()
    (src / "tokenizer.json").write_text(spec)
    (src / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "chat_template": template}))
    gguf = _convert(src, tmp_path / "gpt-oss.gguf", "f32")
    assert {t.ggml_type.name for n, t in read_header(gguf).tensors.items() if "_exps.weight" in n} == {"MXFP4"}
    assert read_header(gguf).metadata["tokenizer.chat_template"] == template
    ours = Tokenizer(gguf)
    prompts = [ours.encode(text) for text in ("Once upon a time", "日本語のテキスト、русский текст")]
    got = run_together(gguf, prompts, 4, dtype="float32", kernels="torch")
    assert_same_run(got, run_together(src, prompts, 4, dtype="float32", kernels="torch"), "llama.cpp's GGUF vs HF")
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (not in CI)")
    theirs = llama_cpp.Llama(model_path=str(gguf), verbose=False, n_ctx=128, n_threads=2)
    for text in SAMPLE:
        assert ours.encode(text) == theirs.tokenize(text.encode(), add_bos=False, special=True), text
    print(f"gpt-oss: greedy tokens equal to llama.cpp's at {_agreement(gguf, theirs, ours)} positions")
