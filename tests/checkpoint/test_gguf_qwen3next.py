"""Qwen3-Next GGUFs (llama.cpp's `qwen3next`): Gated DeltaNet layers with the converter's steps undone (1 + w norms,
-exp(A_log), the regrouped in_proj_qkvz, the squeezed conv1d), gated full attention, a gated shared expert.

On a tiny GGUF written from a transformers checkpoint as llama.cpp's converter lays it out (tests/fixtures/
gguf_qwen3next.py), beside the float32 folder of the weights it holds:
- the config.json the GGUF implies gives the HF checkpoint's ModelSpec (layer kinds, linear-attention widths, partial
  rotary, shared expert);
- fp32: moeserve's logits on the GGUF equal its logits on that folder bit for bit (kernels=torch), and the greedy
  tokens equal transformers' on it (log-probabilities within 1e-4);
- default settings (bf16, Q8_0 experts read as stored by the C++ op): offloaded == resident;
- a file of llama.cpp's own converter (local only): moeserve's greedy tokens on it equal those on the HF folder it was
  converted from (its 1 + w and -exp(A_log), undone in float32, can move a weight by an ulp), and llama.cpp's greedy
  agreement is printed.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from moeserve.bench.checkpoints import write_tiny_checkpoint
from moeserve.checkpoint.folder import open_checkpoint
from moeserve.models.registry import get_architecture
from tests.fixtures.gguf_qwen3next import write_gguf, write_reference
from tests.models.exactness import (
    assert_offloaded_equals_resident,
    assert_outs_match_transformers,
    assert_same_run,
    random_prompts,
    run_together,
)

PROMPTS = random_prompts(7, (5, 11))
STEPS = 5


def _source(folder: Path, **overrides: object) -> Path:
    """The tiny Qwen3-Next with equal key and value head widths (llama.cpp's qwen3next needs them equal)."""
    return write_tiny_checkpoint(folder, "qwen3_next", "float32", 0, linear_value_head_dim=16, **overrides)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(HF checkpoint, its GGUF with Q8_0 experts and matrices, the float32 folder of the GGUF's weights)."""
    root = tmp_path_factory.mktemp("gguf_qwen3next")
    src = _source(root / "src")
    return src, write_gguf(src, root / "qwen3next.gguf"), write_reference(src, root / "ref")


def _spec(path: Path):
    config = open_checkpoint(path).config
    return get_architecture(config, str(path)).spec(config, str(path))


def test_config_gives_the_checkpoints_spec(files) -> None:
    src, gguf, _ = files
    got = _spec(gguf)
    assert got.linear_attention is not None and got.linear_attention.layers == (0, 1, 2)
    assert got == dataclasses.replace(_spec(src), config_dtype="bfloat16")  # the checkpoint is float32


def test_fp32_logits_equal_the_dequantized_weights_and_tokens_equal_transformers(files) -> None:
    from transformers import AutoModelForCausalLM

    _, gguf, ref = files
    got = run_together(gguf, PROMPTS, STEPS, dtype="float32", kernels="torch")
    assert_same_run(got, run_together(ref, PROMPTS, STEPS, dtype="float32", kernels="torch"), "GGUF vs dequantized")
    hf = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    assert_outs_match_transformers(got.outs, hf, PROMPTS, STEPS)


def test_offloaded_equals_resident_with_experts_in_their_ggml_type(files) -> None:
    _, gguf, _ = files
    run = assert_offloaded_equals_resident(gguf, PROMPTS, steps=STEPS)
    assert "stored as gguf-q8_0" in run.choices["experts"], run.choices["experts"]


@pytest.mark.slow
def test_llama_cpp_converter_file_gives_the_folders_tokens(tmp_path: Path) -> None:
    """llama.cpp's converter (local only) on the tiny checkpoint with the Qwen2 vocabulary, F32."""
    from moeserve.tokenizer import Tokenizer
    from tests.checkpoint.test_gguf_llama_cpp import LLAMA_CPP_SRC, VOCAB, _agreement, _convert
    from tests.checkpoint.test_gguf_llama_cpp import _source as with_vocabulary

    if not (LLAMA_CPP_SRC / "convert_hf_to_gguf.py").is_file() or not VOCAB.is_file():
        pytest.skip(f"llama.cpp's source is not at {LLAMA_CPP_SRC} (set LLAMA_CPP_SRC; not in CI)")
    src = with_vocabulary(tmp_path / "src", "qwen3_next", linear_value_head_dim=16)
    gguf = _convert(src, tmp_path / "qwen3next-f32.gguf", "f32", "--no-mtp")  # the tiny checkpoint has no MTP
    assert _spec(gguf) == dataclasses.replace(_spec(src), config_dtype="bfloat16")
    ours = Tokenizer(gguf)
    prompts = [ours.encode(text) for text in ("Once upon a time", "日本語のテキスト、русский текст")]
    got = run_together(gguf, prompts, 4, dtype="float32")
    assert [o[0] for o in got.outs] == [o[0] for o in run_together(src, prompts, 4, dtype="float32").outs]
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (not in CI)")
    theirs = llama_cpp.Llama(model_path=str(gguf), verbose=False, n_ctx=128, n_threads=2)
    print(f"qwen3next: greedy tokens equal to llama.cpp's at {_agreement(gguf, theirs, ours)} positions")
