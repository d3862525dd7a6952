"""GGUF architectures beyond the Qwen / Mixtral / OLMoE layouts, on tiny GGUFs written from transformers checkpoints
(tests/fixtures/gguf_files.py, llama.cpp's converter's names and metadata):

- glm4moe (GLM-4.5): the config.json the GGUF implies gives the same ModelSpec as the HF checkpoint's (partial
  rotary from rope.dimension_count, sigmoid routing with the exp_probs_b correction bias, shared experts, the first
  dense layer, q/k norms, q/k/v biases, NextN layers counted in block_count and their tensors skipped); fp32 logits
  on the GGUF equal those on the same weights dequantized by the gguf package (kernels=torch, as
  test_gguf_models.py), greedy tokens equal transformers'; offloaded == resident with experts in their ggml type;
  a file of llama.cpp's own converter (local only) gives the HF checkpoint's fp32 logits bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from moeserve.bench.checkpoints import CHATML_TEMPLATE, write_tiny_checkpoint
from moeserve.checkpoint.folder import open_checkpoint
from moeserve.checkpoint.gguf.header import read_header
from moeserve.checkpoint.gguf.tokenizer import gguf_tokenizer
from moeserve.errors import UnsupportedModelError
from moeserve.models.registry import get_architecture
from moeserve.tokenizer import Tokenizer
from tests.engine.test_parity_transformers import hf_greedy
from tests.fixtures.gguf_files import write_gguf, write_reference
from tests.models.exactness import (
    assert_offloaded_equals_resident,
    assert_same_run,
    random_prompts,
    run_together,
)

PROMPTS = random_prompts(7, (5, 11))
STEPS = 5
GLM_EXPERTS = {"gate": "Q8_0", "up": "Q4_0", "down": "MXFP4"}


@pytest.fixture(scope="module")
def glm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(HF checkpoint: 2 expert groups, one NextN layer announced; its GGUF; the GGUF's weights dequantized)."""
    root = tmp_path_factory.mktemp("gguf_glm4moe")
    src = write_tiny_checkpoint(root / "src", "glm4_moe", "float32", 0, num_nextn_predict_layers=1)
    gguf = write_gguf(src, root / "glm.gguf", GLM_EXPERTS, "Q8_0")
    return src, gguf, write_reference(src, GLM_EXPERTS, "Q8_0", root / "ref")


def _spec(path: Path):
    config = open_checkpoint(path).config
    return get_architecture(config, str(path)).spec(config, str(path))


def test_glm4moe_config_gives_the_checkpoints_spec_and_skips_the_nextn_layer(glm) -> None:
    src, gguf, _ = glm
    ckpt = open_checkpoint(gguf)
    assert ckpt.config["num_hidden_layers"] == 3 and ckpt.config["num_nextn_predict_layers"] == 1
    assert not any(".layers.3." in n for n in ckpt.tensors)
    got = _spec(gguf)
    assert got.config_dtype == "bfloat16"  # a GGUF names none: the compute default
    assert got == dataclasses.replace(_spec(src), config_dtype="bfloat16")  # the checkpoint is float32


def test_glm4moe_fp32_logits_equal_the_dequantized_checkpoint_and_tokens_equal_transformers(glm) -> None:
    from transformers import AutoModelForCausalLM

    _, gguf, ref = glm
    got = run_together(gguf, PROMPTS, STEPS, dtype="float32", kernels="torch")
    assert_same_run(got, run_together(ref, PROMPTS, STEPS, dtype="float32", kernels="torch"), "glm4moe")
    hf = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    for prompt, (tokens, logprobs) in zip(PROMPTS, got.outs, strict=True):
        ref_tokens, ref_logps = hf_greedy(hf, prompt, STEPS)
        assert tokens == ref_tokens, len(prompt)
        for lp, ref_lp in zip(logprobs, ref_logps, strict=True):
            for token_id, entry in lp.items():
                assert abs(entry.logprob - float(ref_lp[token_id])) < 1e-4, token_id


def test_glm4moe_offloaded_equals_resident_with_experts_in_their_ggml_type(glm) -> None:
    _, gguf, _ = glm
    run = assert_offloaded_equals_resident(gguf, PROMPTS, steps=STEPS)
    assert "stored as gguf-" in run.choices["experts"], run.choices["experts"]


def test_glm4moe_softmax_gating_is_one_line(glm, tmp_path: Path) -> None:
    import gguf as gguf_pkg

    from moeserve.checkpoint.gguf.archs import GGUF_ARCHS

    meta = {"glm4moe.expert_gating_func": int(gguf_pkg.ExpertGatingFuncType.SOFTMAX)}
    config = {"num_hidden_layers": 3, "head_dim": 16}
    with pytest.raises(UnsupportedModelError, match="glm4moe.expert_gating_func") as e:
        GGUF_ARCHS["glm4moe"].derive(config, meta, {}, tmp_path / "x.gguf")  # type: ignore[misc]
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_glm4moe_llama_cpp_f32_file_gives_the_checkpoint_logits_bit_for_bit(tmp_path: Path) -> None:
    """A file of llama.cpp's own converter (local only, as test_gguf_llama_cpp.py): the Qwen2 vocabulary with the
    added tokens its GLM vocabulary code looks up ([gMASK], <|user|>, <|observation|>)."""
    from tests.checkpoint.test_gguf_llama_cpp import LLAMA_CPP_SRC, VOCAB, _convert

    if not (LLAMA_CPP_SRC / "convert_hf_to_gguf.py").is_file() or not VOCAB.is_file():
        pytest.skip(f"llama.cpp's source is not at {LLAMA_CPP_SRC} (set LLAMA_CPP_SRC; not in CI)")
    src = _glm_source(tmp_path / "src")
    gguf = _convert(src, tmp_path / "glm-f32.gguf", "f32")
    assert read_header(gguf).metadata["glm4moe.nextn_predict_layers"] == 1
    prompts = [Tokenizer(src).encode(text) for text in ("Once upon a time", "日本語のテキスト、русский текст")]
    got = run_together(gguf, prompts, 4, dtype="float32")
    assert_same_run(got, run_together(src, prompts, 4, dtype="float32"), "glm4moe: llama.cpp's F32 GGUF vs folder")


def _glm_source(folder: Path) -> Path:
    from tests.checkpoint.test_gguf_llama_cpp import VOCAB

    spec_text, _ = gguf_tokenizer(VOCAB)
    tokens = read_header(VOCAB).metadata["tokenizer.ggml.tokens"]
    spec = json.loads(spec_text)
    for i, token in enumerate(("[gMASK]", "<|user|>", "<|observation|>")):
        spec["added_tokens"].append({"id": len(tokens) + i, "content": token, "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": True})
    write_tiny_checkpoint(folder, "glm4_moe", "float32", 0, vocab_size=len(tokens) + 3,
                          eos_token_id=tokens.index("<|im_end|>"), num_nextn_predict_layers=1)
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "chat_template": CHATML_TEMPLATE}))
    return folder
