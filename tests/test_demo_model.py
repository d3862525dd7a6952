"""The trained demo MoE model shipped in moeserve/demo_model/ (see docs/demo-model.md)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import moeserve

DEMO = Path(moeserve.__file__).resolve().parent / "demo_model"
REQUIRED = [
    "config.json",
    "model.safetensors",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "README.md",
]

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(DEMO)


@pytest.fixture(scope="module")
def model():
    m = transformers.AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32)
    m.eval()
    return m


def test_required_files_present():
    missing = [name for name in REQUIRED if not (DEMO / name).is_file()]
    assert not missing, f"demo model folder lacks {missing}"


def test_folder_size_under_50_mb():
    size = sum(f.stat().st_size for f in DEMO.rglob("*") if f.is_file())
    assert size < 50 * 1024 * 1024, f"demo model folder is {size / 1e6:.1f} MB"


def test_config_is_a_small_top2_moe():
    cfg = json.loads((DEMO / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe"
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    assert 8 <= cfg.get("num_experts", cfg.get("num_local_experts", 0)) <= 16
    assert cfg["num_experts_per_tok"] == 2
    assert cfg["norm_topk_prob"] is True
    assert cfg["mlp_only_layers"] == []


def test_tokenizer_special_tokens_and_chat_template(tokenizer):
    for token in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert token in tokenizer.get_vocab()
    assert tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.pad_token is not None and tokenizer.bos_token is not None
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer("Once upon a time").input_ids
    assert tokenizer.decode(ids) == "Once upon a time"


def test_generation_config_eos(tokenizer):
    gen = json.loads((DEMO / "generation_config.json").read_text())
    eos = gen["eos_token_id"]
    eos = eos if isinstance(eos, list) else [eos]
    assert tokenizer.convert_tokens_to_ids("<|endoftext|>") in eos


def test_weights_are_bf16_and_model_is_moe(model):
    from safetensors import safe_open

    with safe_open(str(DEMO / "model.safetensors"), framework="pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"BF16"}
    n_params = sum(p.numel() for p in model.parameters())
    assert 3e6 <= n_params <= 25e6
    assert type(model).__name__ == "Qwen3MoeForCausalLM"


def test_greedy_generation_is_ascii_words(model, tokenizer):
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    new = out[0, ids.shape[1] :]
    assert new.numel() == 8
    text = tokenizer.decode(new, skip_special_tokens=True)
    assert text.isascii(), repr(text)
    words = re.findall(r"[A-Za-z]+", text)
    assert len(words) >= 3, repr(text)
    # Text is words, spaces and ordinary punctuation, not byte soup.
    assert re.fullmatch(r"[A-Za-z0-9\s.,;:!?'\"()\-]*", text), repr(text)


def test_routing_is_not_collapsed(model, tokenizer):
    """Several experts are used in every layer, and not uniformly."""
    text = (
        "It was a fine morning, and the whole party set out for the village. She had not seen "
        "her sister for many weeks, and was very glad to find her in good health and spirits."
    )
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model(input_ids=ids, output_router_logits=True)
    k = model.config.num_experts_per_tok
    n = model.config.num_experts
    for layer_logits in out.router_logits:
        counts = torch.bincount(layer_logits.topk(k, dim=-1).indices.flatten(), minlength=n)
        assert (counts > 0).sum() >= 3
