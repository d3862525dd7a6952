"""Checkpoint writers for the benchmarks, the research scripts and the tests.

- `write_synthetic_checkpoint`: a Qwen3-MoE in the real Hugging Face layout (per-expert Linears, sharded, with
  `model.safetensors.index.json`), streamed to disk one tensor at a time (never held in memory); 2.25 GiB of experts
  with the default SYNTH_CONFIG, so an expert cache of 0.5 GiB holds under a quarter of them.
- `write_tiny_checkpoint`: a random-init model of a tiny config per architecture (TINY_CONFIGS), saved by
  transformers' own `save_pretrained` (the independent reference); `write_tiny_tokenizer`: a byte-level BPE
  tokenizer with a ChatML template, trained here on a few sentences.
- `randomize_zero_inits` / `randomize_gpt_oss_zeros`: values for the tensors transformers inits to zero, so the
  code that reads them is tested.

transformers and tokenizers are imported inside the writers that need them (transformers is a dev dependency).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

# 8 layers x 64 experts of 3 x 1024 x 768 bf16 (4.5 MiB) = 2.25 GiB of experts; ~60 MiB of everything else.
SYNTH_CONFIG: dict[str, Any] = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=1024, intermediate_size=2048,
    moe_intermediate_size=768, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
    num_experts=64, num_experts_per_tok=4, vocab_size=4096, max_position_embeddings=2048, rms_norm_eps=1e-6,
    rope_theta=10000.0, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
    dtype="bfloat16", eos_token_id=0, bos_token_id=1,
)


def synth_tensors(cfg: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of a Qwen3-MoE checkpoint with config `cfg`, shard by shard order."""
    h, i, e = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts"]
    nh, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    yield "model.embed_tokens.weight", (cfg["vocab_size"], h)
    for L in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{L}."
        yield from (
            (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (nh * d, h)), (p + "self_attn.k_proj.weight", (nkv * d, h)),
            (p + "self_attn.v_proj.weight", (nkv * d, h)), (p + "self_attn.o_proj.weight", (h, nh * d)),
            (p + "self_attn.q_norm.weight", (d,)), (p + "self_attn.k_norm.weight", (d,)),
            (p + "mlp.gate.weight", (e, h)),
        )
        for x in range(e):
            q = f"{p}mlp.experts.{x}."
            yield from ((q + "gate_proj.weight", (i, h)), (q + "up_proj.weight", (i, h)), (q + "down_proj.weight", (h, i)))
    yield "model.norm.weight", (h,)
    yield "lm_head.weight", (cfg["vocab_size"], h)


def _synth_values(name: str, shape: tuple[int, ...], bases: dict[tuple[int, ...], torch.Tensor]) -> torch.Tensor:
    """Deterministic weights: norms are ones; matrices are a per-shape random base, shifted per tensor (cheap)."""
    if len(shape) == 1:
        return torch.ones(shape, dtype=torch.bfloat16)
    if shape not in bases:
        g = torch.Generator().manual_seed(len(bases))
        bases[shape] = (torch.randn(shape, generator=g) * 0.05).to(torch.bfloat16)
    shift = sum(map(ord, name)) % shape[1]
    return torch.roll(bases[shape], shifts=shift, dims=1)


def write_synthetic_checkpoint(folder: Path, cfg: dict[str, Any] = SYNTH_CONFIG, layers_per_shard: int = 2) -> Path:
    """Stream a safetensors checkpoint of Qwen3-MoE config `cfg` to `folder`, one tensor in memory at a time, in
    shards of `layers_per_shard` layers (embeddings and head in the first). Returns `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    for name, shape in synth_tensors(cfg):
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
        want = 0 if layer < 0 else 1 + layer // layers_per_shard
        while len(shards) <= want:
            shards.append([])
        shards[want].append((name, shape))
    weight_map: dict[str, str] = {}
    bases: dict[tuple[int, ...], torch.Tensor] = {}
    total = 0
    for index, tensors in enumerate(shards):
        fname = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {}, 0
        for name, shape in tensors:
            nbytes = 2 * int(torch.Size(shape).numel())
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = fname
        blob = json.dumps(header).encode()
        blob += b" " * (-len(blob) % 8)
        with open(folder / fname, "wb") as f:
            f.write(struct.pack("<Q", len(blob)) + blob)
            for name, shape in tensors:
                f.write(_synth_values(name, shape, bases).view(torch.uint8).numpy().tobytes())
            total += offset
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


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
    # MiniMax-M2: one RMSNorm over all q heads and one over all k heads, rotary on 8 of each head's 16 dims
    # (rotary_dim), sigmoid routing with a correction bias (randomized) choosing 2 of 8 experts, renormalised
    "minimax_m2": dict(
        model_type="minimax_m2", hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rotary_dim=8, num_local_experts=8, num_experts_per_tok=2,
        vocab_size=300, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
    ),
}
ARCHS = tuple(TINY_CONFIGS)

# Larger-than-default init spreads the logits, so greedy decoding of a random model has no near-ties.
INIT_RANGE = 0.08


def write_tiny_checkpoint(folder: Path, arch: str, dtype: str = "float32", seed: int = 0,
                          **overrides: Any) -> Path:
    """Random-init `arch` model (TINY_CONFIGS, `overrides` on top) saved by transformers' save_pretrained into
    `folder` (no tokenizer). Returns `folder`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {**TINY_CONFIGS[arch], "initializer_range": INIT_RANGE, **overrides}
    model_type = kwargs.pop("model_type")
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    randomize_zero_inits(model)
    model.save_pretrained(folder)
    return folder


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


def write_tiny_text_model(folder: Path, arch: str = "qwen3_moe", **overrides: Any) -> Path:
    """A tiny `arch` checkpoint with the tiny tokenizer, its vocabulary and eos (random weights: the text it
    writes is gibberish; it shows the plumbing). Returns `folder`."""
    from tokenizers import Tokenizer

    write_tiny_tokenizer(folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    write_tiny_checkpoint(folder, arch, vocab_size=tok.get_vocab_size(), eos_token_id=eos, **overrides)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return folder


def randomize_gpt_oss_zeros(model: Any) -> None:
    """transformers inits gpt-oss expert biases and sinks to zero: give them values so they are tested."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.experts.gate_up_proj_bias.normal_(0.0, 0.08)
            layer.mlp.experts.down_proj_bias.normal_(0.0, 0.08)
            layer.self_attn.sinks.normal_(0.0, 1.0)


def randomize_zero_inits(model: Any, std: float = 0.1) -> None:
    """transformers inits the routing correction biases (e_score_correction_bias) to zero: give them values, so the
    choice they shift (and only the choice: the weights are the unbiased scores) is tested."""
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a buffer (DeepSeek-V3, GLM-4.5) or a parameter
                buffer.normal_(0.0, std)
        # zero-centred RMSNorms (Qwen3-Next, Qwen3.5) init their weight w to 0 (scale 1 + w): give them values, so a
        # norm that scaled by w, or ignored it, is caught
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") and param.dim() == 1 and not param.any():
                param.normal_(0.0, std)
