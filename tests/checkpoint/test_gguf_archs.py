"""GGUF architectures beyond the Qwen / Mixtral / OLMoE layouts, on tiny GGUFs written from transformers checkpoints
(tests/fixtures/gguf_files.py, llama.cpp's converter's names and metadata):

- glm4moe (GLM-4.5) and deepseek2 (DeepSeek-V3: MLA with kv_b_proj split into attn_k_b / attn_v_b, q LoRA,
  grouped sigmoid routing): the config.json the GGUF implies gives the same ModelSpec as the HF checkpoint's (partial
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


EXPERTS = {"gate": "Q8_0", "up": "Q4_0", "down": "MXFP4"}


def _glm_src(folder: Path) -> Path:  # 2 expert groups, one NextN layer announced
    return write_tiny_checkpoint(folder, "glm4_moe", "float32", 0, num_nextn_predict_layers=1)


def _deepseek_src(folder: Path) -> Path:
    """q LoRA, 2 expert groups, a dense first layer; no MTP layer (llama.cpp's deepseek2 converter drops them and
    writes no count)."""
    from tests.models.test_deepseek_v3 import write_tiny

    return write_tiny(folder, num_nextn_predict_layers=0)


SOURCES = {"glm4moe": _glm_src, "deepseek2": _deepseek_src}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory):
    """arch -> (HF checkpoint, its GGUF, the GGUF's weights dequantized), made once."""
    made: dict[str, tuple[Path, Path, Path]] = {}

    def get(arch: str) -> tuple[Path, Path, Path]:
        if arch not in made:
            root = tmp_path_factory.mktemp(f"gguf_{arch}")
            src = SOURCES[arch](root / "src")
            gguf = write_gguf(src, root / f"{arch}.gguf", EXPERTS, "Q8_0")
            made[arch] = src, gguf, write_reference(src, EXPERTS, "Q8_0", root / "ref")
        return made[arch]

    return get


def _spec(path: Path):
    config = open_checkpoint(path).config
    return get_architecture(config, str(path)).spec(config, str(path))


@pytest.mark.parametrize("arch", list(SOURCES))
def test_config_gives_the_checkpoints_spec(files, arch: str) -> None:
    src, gguf, _ = files(arch)
    ckpt = open_checkpoint(gguf)
    assert ckpt.config["num_hidden_layers"] == 3
    assert not any(".layers.3." in n for n in ckpt.tensors)  # glm4moe: its NextN layer's tensors are not read
    got = _spec(gguf)
    assert got.config_dtype == "bfloat16"  # a GGUF names none: the compute default
    assert got == dataclasses.replace(_spec(src), config_dtype="bfloat16")  # the checkpoint is float32


@pytest.mark.parametrize("arch", list(SOURCES))
def test_fp32_logits_equal_the_dequantized_checkpoint_and_tokens_equal_transformers(files, arch: str) -> None:
    from transformers import AutoModelForCausalLM

    _, gguf, ref = files(arch)
    got = run_together(gguf, PROMPTS, STEPS, dtype="float32", kernels="torch")
    assert_same_run(got, run_together(ref, PROMPTS, STEPS, dtype="float32", kernels="torch"), arch)
    hf = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    for prompt, (tokens, logprobs) in zip(PROMPTS, got.outs, strict=True):
        ref_tokens, ref_logps = hf_greedy(hf, prompt, STEPS)
        assert tokens == ref_tokens, (arch, len(prompt))
        for lp, ref_lp in zip(logprobs, ref_logps, strict=True):
            for token_id, entry in lp.items():
                assert abs(entry.logprob - float(ref_lp[token_id])) < 1e-4, (arch, token_id)


@pytest.mark.parametrize("arch", list(SOURCES))
def test_offloaded_equals_resident_with_experts_in_their_ggml_type(files, arch: str) -> None:
    _, gguf, _ = files(arch)
    run = assert_offloaded_equals_resident(gguf, PROMPTS, steps=STEPS)
    assert "stored as gguf-" in run.choices["experts"], run.choices["experts"]


@pytest.mark.parametrize("arch", list(SOURCES))
def test_softmax_gating_is_one_line(arch: str, tmp_path: Path) -> None:
    import gguf as gguf_pkg

    from moeserve.checkpoint.gguf.archs import GGUF_ARCHS

    meta = {f"{arch}.expert_gating_func": int(gguf_pkg.ExpertGatingFuncType.SOFTMAX)}
    config = {"num_hidden_layers": 3, "head_dim": 16, "qk_rope_head_dim": 8}
    with pytest.raises(UnsupportedModelError, match=f"{arch}.expert_gating_func") as e:
        GGUF_ARCHS[arch].derive(config, meta, {}, tmp_path / "x.gguf")  # type: ignore[misc]
    assert "\n" not in str(e.value)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["glm4moe", "deepseek2-yarn"])
def test_llama_cpp_f32_file_gives_the_checkpoint_logits_bit_for_bit(arch: str, tmp_path: Path) -> None:
    """A file of llama.cpp's own converter (local only, as test_gguf_llama_cpp.py), from a tiny checkpoint with the
    Qwen2 vocabulary; DeepSeek-V3 with yarn (mscale = mscale_all_dim, as DeepSeek-V3 and Kimi-K2 hold it: a GGUF
    keeps only 0.1 * mscale_all_dim) and scoring_func "sigmoid" (as its config.json names it; transformers saves
    none, and llama.cpp reads a file without it as DeepSeek-V2's softmax)."""
    from tests.checkpoint.test_gguf_llama_cpp import LLAMA_CPP_SRC, VOCAB, _convert

    if not (LLAMA_CPP_SRC / "convert_hf_to_gguf.py").is_file() or not VOCAB.is_file():
        pytest.skip(f"llama.cpp's source is not at {LLAMA_CPP_SRC} (set LLAMA_CPP_SRC; not in CI)")
    src = _converter_source(tmp_path / "src", arch)
    gguf = _convert(src, tmp_path / f"{arch}-f32.gguf", "f32")
    prompts = [Tokenizer(src).encode(text) for text in ("Once upon a time", "日本語のテキスト、русский текст")]
    got = run_together(gguf, prompts, 4, dtype="float32")
    assert_same_run(got, run_together(src, prompts, 4, dtype="float32"), f"{arch}: llama.cpp's F32 GGUF vs folder")
    assert _spec(gguf) == dataclasses.replace(_spec(src), config_dtype="bfloat16")


def _converter_source(folder: Path, arch: str) -> Path:
    """The tiny checkpoint of `arch` with the Qwen2 vocabulary; glm4moe's with the added tokens the converter's GLM
    vocabulary code looks up ([gMASK], <|user|>, <|observation|>)."""
    from tests.checkpoint.test_gguf_llama_cpp import VOCAB
    from tests.models.test_deepseek_v3 import YARN, write_tiny

    spec_text, _ = gguf_tokenizer(VOCAB)
    tokens = read_header(VOCAB).metadata["tokenizer.ggml.tokens"]
    spec = json.loads(spec_text)
    extra = ("[gMASK]", "<|user|>", "<|observation|>") if arch == "glm4moe" else ()
    for i, token in enumerate(extra):
        spec["added_tokens"].append({"id": len(tokens) + i, "content": token, "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": True})
    vocab = {"vocab_size": len(tokens) + len(extra), "eos_token_id": tokens.index("<|im_end|>")}
    if arch == "glm4moe":
        write_tiny_checkpoint(folder, "glm4_moe", "float32", 0, num_nextn_predict_layers=1, **vocab)
    else:
        write_tiny(folder, scoring_func="sigmoid", num_nextn_predict_layers=0,
                   rope_parameters={**YARN, "mscale": YARN["mscale_all_dim"]}, **vocab)
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "chat_template": CHATML_TEMPLATE}))
    return folder


@pytest.mark.slow
def test_glm4_pre_tokenizer_ids_equal_llama_cpp(tmp_path: Path) -> None:
    """tokenizer.ggml.pre "glm4" (GLM-4.5's GGUFs): moeserve's ids equal llama.cpp's on the multilingual sample and
    special tokens (a tiny glm4moe GGUF with the Qwen2 vocabulary, local only)."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (not in CI)")
    from tests.checkpoint.test_gguf_llama_cpp import LLAMA_CPP_SRC, VOCAB
    from tests.checkpoint.test_gguf_tokenizer import SAMPLE

    if not VOCAB.is_file():
        pytest.skip(f"llama.cpp's source is not at {LLAMA_CPP_SRC} (set LLAMA_CPP_SRC; not in CI)")
    src = _converter_source(tmp_path / "src", "glm4moe")
    gguf = write_gguf(src, tmp_path / "glm4.gguf", "Q8_0", "F32", tokenizer=src, tokenizer_pre="glm4")
    theirs = llama_cpp.Llama(model_path=str(gguf), verbose=False, vocab_only=True)
    ours = Tokenizer(gguf)
    for text in SAMPLE:
        assert ours.encode(text) == theirs.tokenize(text.encode(), add_bos=True, special=True), text
