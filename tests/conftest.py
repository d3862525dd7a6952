"""Shared fixtures: tiny checkpoints written by transformers' own save_pretrained (the independent reference).

`tiny_checkpoint(arch, dtype="float32", **config_overrides)` returns the folder of a random-init model of that
architecture, built once per test session per argument set. `tiny_tokenizer_dir` is a byte-level BPE tokenizer
(trained here with the `tokenizers` library) with a ChatML chat template, for tests that need text.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

# Base configs per architecture: tiny, but with every switch the engine must honour.
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(
        model_type="qwen3_moe", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=2, vocab_size=300, mlp_only_layers=[1], norm_topk_prob=True,
        max_position_embeddings=512,
    ),
    "qwen2_moe": dict(
        model_type="qwen2_moe", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=8, num_experts_per_tok=2, vocab_size=300, max_position_embeddings=512,
    ),
    "mixtral": dict(
        model_type="mixtral", hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, vocab_size=300,
        max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
    ),
    "olmoe": dict(
        model_type="olmoe", hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, vocab_size=300,
        max_position_embeddings=512, eos_token_id=2, pad_token_id=1,
    ),
    # GLM-4.5: a dense first layer, 2 groups of 4 experts (topk_group 1), 2 shared experts, q/k norm, biases on q/k/v,
    # rotary on half of each head, routed_scaling_factor; correction biases randomized (randomize_zero_inits)
    "glm4_moe": dict(
        model_type="glm4_moe", hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
        n_group=2, topk_group=1, n_shared_experts=2, first_k_dense_replace=1, attention_bias=True, use_qk_norm=True,
        partial_rotary_factor=0.5, routed_scaling_factor=2.5, norm_topk_prob=True, vocab_size=300,
        max_position_embeddings=512,
    ),
    # Qwen3-Next: 3 Gated DeltaNet layers then 1 gated full-attention layer (layer_types from full_attention_interval),
    # 2 key heads for 4 value heads, partial rotary 0.25, a gated shared expert, zero-centred norms (randomized)
    "qwen3_next": dict(
        model_type="qwen3_next", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_experts=8, num_experts_per_tok=2, vocab_size=300, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        full_attention_interval=4, partial_rotary_factor=0.25, max_position_embeddings=512,
    ),
}
ARCHS = tuple(TINY_CONFIGS)

# Larger-than-default init spreads the logits, so greedy decoding of a random model has no near-ties.
INIT_RANGE = 0.08


def write_tiny_checkpoint(folder: Path, arch: str, dtype: str = "float32", seed: int = 0,
                          **overrides: Any) -> Path:
    """Random-init `arch` model saved by transformers' save_pretrained into `folder` (no tokenizer)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.models.checkpoints import randomize_zero_inits

    kwargs = {**TINY_CONFIGS[arch], "initializer_range": INIT_RANGE, **overrides}
    model_type = kwargs.pop("model_type")
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    randomize_zero_inits(model)
    model.save_pretrained(folder)
    return folder



@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    cache: dict[str, Path] = {}

    def make(arch: str, dtype: str = "float32", seed: int = 0, **overrides: Any) -> Path:
        key = json.dumps([arch, dtype, seed, overrides], sort_keys=True)
        if key not in cache:
            folder = tmp_path_factory.mktemp(f"tiny_{arch}_{dtype}")
            cache[key] = write_tiny_checkpoint(folder, arch, dtype, seed, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def checkpoint_once(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, Callable[[Path], Path]], Path]:
    """`get(key, build)`: the folder `build(empty_folder)` returned the first time `key` was asked for in this
    session; later calls (from any module) get the same folder. Tests must not write into it (copy_checkpoint)."""
    cache: dict[str, Path] = {}

    def get(key: str, build: Callable[[Path], Path]) -> Path:
        if key not in cache:
            cache[key] = build(tmp_path_factory.mktemp(key.replace(".", "_").replace("/", "_")))
        return cache[key]

    return get


@pytest.fixture(scope="session")
def real_dims_checkpoint(checkpoint_once: Callable[[str, Callable[[Path], Path]], Path]) -> Callable[[str], Path]:
    """`name`'s checkpoint at real dimensions (tests/real_dims.py, seed 0, 2 layers), written once per session:
    the engine, batch-invariance and offload suites read the same folders. `NAME-mxfp4` is NAME's checkpoint with
    its experts in MXFP4 (gpt-oss's published layout, tests/models/checkpoints.py)."""
    from tests.models.checkpoints import write_gpt_oss_mxfp4
    from tests.real_dims import write_real_dims

    def get(name: str) -> Path:
        if name.endswith("-mxfp4"):
            bf16 = get(name.removesuffix("-mxfp4"))
            return checkpoint_once(f"real_dims-{name}", lambda folder: write_gpt_oss_mxfp4(bf16, folder))
        return checkpoint_once(f"real_dims-{name}", lambda folder: write_real_dims(folder, name))

    return get


@pytest.fixture
def copy_checkpoint(tmp_path: Path) -> Callable[[Path], Path]:
    """A private copy of a checkpoint folder that a test may corrupt."""

    def copy(src: Path) -> Path:
        dst = tmp_path / "model"
        shutil.copytree(src, dst)
        return dst

    return copy


TRAIN_TEXT = [
    "Once upon a time there was a little fox who lived in the forest.",
    "The fox liked to run and play with the birds in the morning sun.",
    "One day the fox found a shiny stone near the river and took it home.",
    "Hello, how are you? I am fine, thank you. What is your name?",
    "The quick brown fox jumps over the lazy dog. 0123456789 !?.,;:",
]

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
    " + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def write_tiny_tokenizer(folder: Path, vocab_size: int = 300) -> Path:
    """Byte-level BPE trained on a few sentences; eos '<|im_end|>'; ChatML template in tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TRAIN_TEXT * 20, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
        "chat_template": CHATML_TEMPLATE,
    }))
    return folder


@pytest.fixture(scope="session")
def tiny_text_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-MoE checkpoint with a tokenizer and chat template (random weights)."""
    folder = tmp_path_factory.mktemp("tiny_text_model")
    write_tiny_tokenizer(folder)
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size()
    eos = Tokenizer.from_file(str(folder / "tokenizer.json")).token_to_id("<|im_end|>")
    write_tiny_checkpoint(folder, "qwen3_moe", vocab_size=vocab, eos_token_id=eos)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return folder


def has_cuda() -> bool:
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not has_cuda():
            item.add_marker(skip_gpu)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True, scope="session")
def _int8_spill_files_in_a_temporary_folder(tmp_path_factory: pytest.TempPathFactory):
    """quantization=int8 offloaded writes its spill file under ~/.cache by default: tests keep theirs in a
    temporary folder (an explicit int8_cache_dir still wins)."""
    old = os.environ.get("MOESERVE_INT8_CACHE_DIR")
    os.environ["MOESERVE_INT8_CACHE_DIR"] = str(tmp_path_factory.mktemp("int8-spill"))
    yield
    if old is None:
        os.environ.pop("MOESERVE_INT8_CACHE_DIR", None)
    else:
        os.environ["MOESERVE_INT8_CACHE_DIR"] = old
