"""GGUFs written by llama.cpp's own converter (convert_hf_to_gguf.py), where llama.cpp's source is here (not in CI:
skipped, saying why). The tiny checkpoints carry the real Qwen2/3 tokenizer, rebuilt from llama.cpp's
models/ggml-vocab-qwen2.gguf (the converter checks its pre-tokenizer by hashing what it encodes, and takes it).

- F32 files: moeserve's fp32 logits on llama.cpp's GGUF equal its logits on the HF folder it was converted from,
  bit for bit (llama.cpp's names, stacking, and Mixtral's permuted q/k rows all undone exactly);
- Q8_0 files: the tokenizer's ids equal llama.cpp's on a multilingual sample with special tokens, and the model
  decodes; the greedy tokens' agreement with llama.cpp's own decode is printed (numerics differ by design);
- a Q4_K_M file made by llama.cpp's quantizer (LLAMA_QUANTIZE, default /tmp/llama/bin/llama-quantize) from the F32
  file: its experts' down projection changes ggml type across layers (Q4_K / Q6_K), moeserve loads it (units sized
  for the widest type) and decodes; the greedy agreement with llama.cpp is printed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moeserve.bench.checkpoints import CHATML_TEMPLATE, write_tiny_checkpoint
from moeserve.checkpoint.gguf.header import read_header
from moeserve.checkpoint.gguf.tokenizer import gguf_tokenizer
from moeserve.tokenizer import Tokenizer
from tests.checkpoint.test_gguf_tokenizer import LLAMA_CPP_SRC, SAMPLE
from tests.models.exactness import assert_same_run, run_together

pytestmark = pytest.mark.slow
VOCAB = LLAMA_CPP_SRC / "models" / "ggml-vocab-qwen2.gguf"
ARCHS = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe")


LLAMA_QUANTIZE = Path(os.environ.get("LLAMA_QUANTIZE", "/tmp/llama/bin/llama-quantize"))


def _source(folder: Path, arch: str, **overrides: object) -> Path:
    spec, _ = gguf_tokenizer(VOCAB)
    tokens = read_header(VOCAB).metadata["tokenizer.ggml.tokens"]
    eos = tokens.index("<|im_end|>")
    dense_layers = {"mlp_only_layers": []} if arch == "qwen3_moe" else {}  # llama.cpp's qwen3moe has no dense MLP
    write_tiny_checkpoint(folder, arch, "float32", 0, vocab_size=len(tokens), eos_token_id=eos, **dense_layers,
                          **overrides)
    (folder / "tokenizer.json").write_text(spec)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "chat_template": CHATML_TEMPLATE}))
    return folder


def _convert(src: Path, out: Path, outtype: str, *flags: str) -> Path:
    # the converter's own gguf-py, and where its own dependencies are (LLAMA_CPP_CONVERTER_PYTHONPATH: sentencepiece)
    paths = [str(LLAMA_CPP_SRC / "gguf-py"), os.environ.get("LLAMA_CPP_CONVERTER_PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    done = subprocess.run([sys.executable, str(LLAMA_CPP_SRC / "convert_hf_to_gguf.py"), str(src), "--outtype",
                           outtype, "--outfile", str(out), *flags], env=env, capture_output=True, text=True, timeout=600)
    if "No module named 'sentencepiece'" in done.stderr:
        pytest.skip("llama.cpp's converter imports sentencepiece for llama-architecture vocabularies: not installed "
                    "(set LLAMA_CPP_CONVERTER_PYTHONPATH to a folder holding it)")
    assert done.returncode == 0, done.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory):
    if not (LLAMA_CPP_SRC / "convert_hf_to_gguf.py").is_file() or not VOCAB.is_file():
        pytest.skip(f"llama.cpp's source is not at {LLAMA_CPP_SRC} (set LLAMA_CPP_SRC; not in CI)")
    root = tmp_path_factory.mktemp("llama_cpp_gguf")
    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            made[arch] = _source(root / arch, arch)
        return made[arch]

    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_llama_cpp_f32_files_give_the_checkpoint_logits_bit_for_bit(sources, arch: str, tmp_path: Path) -> None:
    src = sources(arch)
    gguf = _convert(src, tmp_path / f"{arch}-f32.gguf", "f32")
    prompts = [Tokenizer(src).encode(text) for text in ("Once upon a time", "日本語のテキスト、русский текст")]
    got = run_together(gguf, prompts, 4, dtype="float32")
    assert_same_run(got, run_together(src, prompts, 4, dtype="float32"), f"{arch}: llama.cpp's F32 GGUF vs folder")


def test_llama_cpp_q8_0_file_tokenizes_as_llama_cpp_and_decodes(sources, tmp_path: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (not in CI)")
    gguf = _convert(sources("qwen3_moe"), tmp_path / "q8_0.gguf", "q8_0")
    ours = Tokenizer(gguf)
    theirs = llama_cpp.Llama(model_path=str(gguf), verbose=False, n_ctx=128, n_threads=2)
    for text in SAMPLE:
        assert ours.encode(text) == theirs.tokenize(text.encode(), add_bos=False, special=True), text
    print(f"greedy tokens equal to llama.cpp's at {_agreement(gguf, theirs, ours)} positions")


def _agreement(gguf: Path, theirs: object, ours: Tokenizer) -> str:
    """'same of total': moeserve's greedy tokens (default settings, 8 per SAMPLE prompt) against llama.cpp's."""
    from moeserve import LLM, SamplingParams

    prompts = [ours.encode(text) for text in SAMPLE]
    llm = LLM(str(gguf))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=8, temperature=0.0,
                                                                                  ignore_eos=True))
    llm.engine.close()
    same = total = 0
    for prompt, out in zip(prompts, outs, strict=True):
        tokens = list(out.outputs[0].token_ids)
        ref = []
        theirs.reset()  # type: ignore[attr-defined]
        for token in theirs.generate(prompt, temp=0.0, top_k=1, reset=True):  # type: ignore[attr-defined]
            ref.append(token)
            if len(ref) == len(tokens):
                break
        same += sum(a == b for a, b in zip(tokens, ref))
        total += len(tokens)
    assert total == 8 * len(prompts)
    return f"{same} of {total}"


def test_llama_cpp_q4_k_m_file_with_per_layer_down_types_decodes(sources, tmp_path: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (not in CI)")
    if not LLAMA_QUANTIZE.is_file():
        pytest.skip(f"llama.cpp's quantizer is not at {LLAMA_QUANTIZE} (set LLAMA_QUANTIZE; not in CI)")
    src = _source(tmp_path / "src", "qwen3_moe", hidden_size=256, moe_intermediate_size=256, head_dim=64,
                  num_hidden_layers=2)  # K-quant rows hold whole 256-value blocks
    f32 = _convert(src, tmp_path / "f32.gguf", "f32")
    gguf = tmp_path / "q4_k_m.gguf"
    done = subprocess.run([str(LLAMA_QUANTIZE), str(f32), str(gguf), "Q4_K_M"], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    types = {n: t.ggml_type.name for n, t in read_header(gguf).tensors.items() if "ffn_down_exps" in n}
    assert len(set(types.values())) > 1, types  # llama.cpp's Q4_K_M: more bits for some layers' down projection
    theirs = llama_cpp.Llama(model_path=str(gguf), verbose=False, n_ctx=128, n_threads=2)
    print(f"Q4_K_M ({types}): greedy tokens equal to llama.cpp's at {_agreement(gguf, theirs, Tokenizer(gguf))} "
          "positions")
