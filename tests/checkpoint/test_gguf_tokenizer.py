"""A GGUF's tokenizer and chat template from its metadata (checkpoint/gguf/tokenizer.py), on the bundled demo model
written as a GGUF the way llama.cpp's converter stores a byte-level BPE: ids equal the model's own tokenizer.json
(and llama.cpp's tokenizer where llama-cpp-python is installed) on a multilingual sample and special tokens; the demo
model served from its GGUF (bf16 weights, exactly the folder's) writes the folder's text."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from moeserve import LLM, SamplingParams
from moeserve.engine.llm_engine import demo_model_path
from moeserve.tokenizer import Tokenizer
from tests.fixtures.gguf_files import write_gguf

SAMPLE = [
    "Hello world! How are you? I'm fine, you'll see.",
    "  two leading spaces\n\nnew lines\tand a tab   ",
    "Ünïcödé: 日本語のテキスト、中文文本, русский текст, Ελληνικά, العربية, हिन्दी, 한국어 🦊🚀",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "numbers 1234567 3.14159 x=y+z; <|endoftext|> after a special token",
]


@pytest.fixture(scope="module")
def demo_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    demo = demo_model_path()
    return write_gguf(demo, tmp_path_factory.mktemp("demo_gguf") / "demo.gguf", "BF16", "BF16", tokenizer=demo)


def test_ids_template_and_special_tokens_equal_the_model_folder(demo_gguf: Path) -> None:
    ours, theirs = Tokenizer(demo_gguf), Tokenizer(demo_model_path())
    for text in SAMPLE:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.chat_template == theirs.chat_template and ours.eos_token_id == theirs.eos_token_id
    assert ours.special_tokens["eos_token"] == theirs.special_tokens["eos_token"]


def test_ids_equal_llama_cpp(demo_gguf: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (not in CI)")
    vocab = llama_cpp.Llama(model_path=str(demo_gguf), vocab_only=True, verbose=False)
    ours = Tokenizer(demo_gguf)
    for text in SAMPLE:
        assert ours.encode(text) == vocab.tokenize(text.encode(), add_bos=False, special=True), text


def test_the_demo_model_served_from_its_gguf_writes_the_folder_text(demo_gguf: Path) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0)
    texts = []
    for model in (demo_gguf, demo_model_path()):
        llm = LLM(str(model))
        texts.append(llm.generate(["Once upon a time"], params)[0].outputs[0].text)
        llm.engine.close()
    assert texts[0] == texts[1] and texts[0]


LLAMA_CPP_SRC = Path(os.environ.get("LLAMA_CPP_SRC", "/tmp/llama/llama_cpp_python-0.3.36/vendor/llama.cpp"))
REAL_VOCABS = ("qwen2", "qwen35", "llama-bpe", "gpt-2", "mpt")  # byte-level BPE vocabularies llama.cpp ships


@pytest.mark.parametrize("name", REAL_VOCABS)
def test_real_vocabularies_match_their_reference_ids_and_llama_cpp(name: str) -> None:
    """llama.cpp's own vocabulary GGUFs (models/ggml-vocab-*.gguf: Qwen2/3's 151,936 tokens, Llama 3's 128,256, ...)
    with its tokenizer test texts (.inp) and the ids the model's HF tokenizer gives them (.out)."""
    vocab = LLAMA_CPP_SRC / "models" / f"ggml-vocab-{name}.gguf"
    if not vocab.is_file():
        pytest.skip(f"llama.cpp's source is not at {LLAMA_CPP_SRC} (set LLAMA_CPP_SRC; not in CI)")
    texts = (vocab.parent / f"{vocab.name}.inp").read_text().split("\n__ggml_vocab_test__\n")
    expected = (vocab.parent / f"{vocab.name}.out").read_text().split("\n")
    ours = Tokenizer(vocab)
    for text, ids in zip(texts, expected, strict=False):
        assert ours.encode(text, add_special_tokens=False) == [int(i) for i in ids.split()], text
    try:
        import llama_cpp
    except ImportError:
        return
    theirs = llama_cpp.Llama(model_path=str(vocab), vocab_only=True, verbose=False)
    for text in [*texts, *SAMPLE]:
        assert ours.encode(text, add_special_tokens=False) == theirs.tokenize(text.encode(), add_bos=False,
                                                                               special=True), text
