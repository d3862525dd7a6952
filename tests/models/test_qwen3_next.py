"""Qwen3-Next (Qwen3NextForCausalLM) and Qwen3.5 MoE (Qwen3_5MoeForConditionalGeneration): Gated DeltaNet hybrids.

- The specs of the published configs (layer pattern, linear-attention shapes, gated attention, zero-centred norms).
- Tiny checkpoints transformers writes (3 linear-attention layers + 1 full, shared expert, zero-centred norm weights
  randomized), fp32: transformers' greedy tokens and log-probabilities within 1e-4, with prompts longer than two
  chunks of the chunk form, decoded together; the C++ kernels and torch alike.
- bf16, default settings: a prompt prefilled in chunks gives the logits of one pass bit for bit; sequences batched
  and preempted (recomputed) finish with their solo tokens and logprobs; offloaded experts == resident.
- Qwen3.5: the language model under model.language_model.* served, the vision tower and mtp.* never read (logged,
  out of the resident size); transformers' greedy tokens in fp32.
- Real dimensions (Qwen3-Next-80B and Qwen3.5-35B truncated to 4 layers): tests/models/test_real_dims_exactness.py.
The comparisons run through the shared driver tests/models/exactness.py.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeserve import LLM
from moeserve.models.registry import get_architecture
from tests.engine.test_parity_transformers import hf_model
from tests.models import exactness as X
from tests.models.exactness import STEPS, assert_matches_transformers

# the published Qwen/Qwen3-Next-80B-A3B-Instruct config.json (shared/reference/configs), the fields read
QWEN3_NEXT_80B = {
    "architectures": ["Qwen3NextForCausalLM"], "attention_bias": False, "decoder_sparse_step": 1,
    "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 5120, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "linear_value_head_dim": 128, "max_position_embeddings": 262144,
    "mlp_only_layers": [], "model_type": "qwen3_next", "moe_intermediate_size": 512, "norm_topk_prob": True,
    "num_attention_heads": 16, "num_experts": 512, "num_experts_per_tok": 10, "num_hidden_layers": 48,
    "num_key_value_heads": 2, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 10000000, "shared_expert_intermediate_size": 512, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936,
}
# Qwen/Qwen3.5-35B-A3B's config.json (text_config; layer_types: 3 linear then 1 full, 10 times)
QWEN35_35B = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe", "tie_word_embeddings": False,
    "text_config": {
        "attention_bias": False, "attn_output_gate": True, "dtype": "bfloat16", "full_attention_interval": 4,
        "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"] + (["linear_attention"] * 3 + ["full_attention"]) * 9,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32, "linear_value_head_dim": 128, "max_position_embeddings": 262144,
        "mlp_only_layers": [], "model_type": "qwen3_5_moe_text", "moe_intermediate_size": 512,
        "mtp_num_hidden_layers": 1, "num_attention_heads": 16, "num_experts": 256, "num_experts_per_tok": 8,
        "num_hidden_layers": 40, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
        "shared_expert_intermediate_size": 512, "vocab_size": 248320,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "default",
                            "rope_theta": 10000000, "partial_rotary_factor": 0.25},
    },
}


@pytest.mark.parametrize("config", [QWEN3_NEXT_80B, QWEN35_35B], ids=["qwen3-next-80b", "qwen3.5-35b"])
def test_spec_of_the_published_configs(config: dict) -> None:
    spec = get_architecture(config, "config.json").spec(config, "config.json")
    la, a, m = spec.linear_attention, spec.attention, spec.moe
    assert la is not None and spec.attention_layers == tuple((i + 1) % 4 == 0 for i in range(spec.num_layers))
    assert (la.num_k_heads, la.num_v_heads, la.k_head_dim, la.v_head_dim, la.conv_kernel) == (16, 32, 128, 128, 4)
    assert la.conv_dim == 2 * 16 * 128 + 32 * 128
    assert a.output_gate and a.qk_norm == "per_head" and (a.num_heads, a.num_kv_heads, a.head_dim) == (16, 2, 256)
    assert spec.rope.rotary_dim(a.head_dim) == 64 and spec.norm_style == "zero_centered"
    assert m.shared_intermediate_size == 512 and m.shared_gated and m.routing == "softmax_topk" and m.norm_topk_prob
    assert all(spec.moe_layers) and spec.config_dtype == "bfloat16"


def test_layer_types_must_name_each_layer() -> None:
    from moeserve.errors import CheckpointError

    config = {**QWEN3_NEXT_80B, "layer_types": ["linear_attention"] * 47}
    with pytest.raises(CheckpointError, match="'layer_types' must list"):
        get_architecture(config, "config.json").spec(config, "config.json")


def long_prompts(seed: int = 0) -> list[list[int]]:
    return X.random_prompts(seed, (150, 5, 70))


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_tiny_qwen3_next_matches_transformers(tiny_checkpoint, kernels: str) -> None:
    folder = tiny_checkpoint("qwen3_next")
    assert_matches_transformers(folder, hf_model(folder, torch.float32), long_prompts(), kernels=kernels)


def test_chunked_prefill_equals_one_pass_bit_for_bit(tiny_checkpoint) -> None:
    """A 200-token prompt in one step and in chunks of 64 (the scheduler cuts on the chunk grid): the same bits."""
    folder = tiny_checkpoint("qwen3_next", dtype="bfloat16")
    prompt = long_prompts(1)[0] + long_prompts(2)[2][:50]
    whole = X.run_together(folder, [prompt])
    chunked = X.assert_chunked_equals_one_pass(folder, prompt, (80,), whole)[80]
    assert (len(whole.logits), len(chunked.logits)) == (STEPS, STEPS + 2)  # 200 tokens: 64 + 64 + 72 (the end)
    assert whole.logits[0].dtype == torch.float32


def test_batched_and_preempted_sequences_keep_their_solo_numbers(tiny_checkpoint) -> None:
    """Four sequences in a full-attention pool of 12 blocks: preempted and recomputed (output tokens by the
    recurrent step again) again and again; each ends with the tokens and logprobs it gets alone (bf16)."""
    folder = tiny_checkpoint("qwen3_next", dtype="bfloat16")
    prompts = X.random_prompts(7, (40,) * 4)
    solo = X.run_alone(folder, prompts, 30, max_model_len=128)
    assert "prefix caching on" in solo.choices["KV cache"]  # recompute after preemption may resume from a snapshot
    X.assert_batched_and_preempted_equal_solo(folder, [(0, p) for p in prompts], 12, 30, 128, solo)


def test_offloaded_equals_resident_in_bf16(tiny_checkpoint) -> None:
    folder = tiny_checkpoint("qwen3_next", dtype="bfloat16")
    prompts = long_prompts(3)
    resident = X.run_together(folder, prompts)
    # per op: conftest's shared expert of 48 is outside the C++ GEMV layouts (the fused step on Qwen3-Next:
    # tests/models/test_decode_stack_kinds.py)
    assert "'onednn' layout" in resident.choices["decode step"]
    assert "3 layers" in resident.choices["linear attention"]
    if resident.choices["kernels"].startswith("cpp"):
        assert "C++ gated_delta_step_" in resident.choices["linear attention"]
    X.assert_offloaded_equals_resident(folder, prompts, resident)


# ------------------------------------------------------------------------------------------------- Qwen3.5
TINY_QWEN35_TEXT = dict(
    hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, vocab_size=300,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
    linear_conv_kernel_dim=4, full_attention_interval=4, max_position_embeddings=512, mtp_num_hidden_layers=1,
    initializer_range=0.08,
)


def write_tiny_qwen35(folder: Path) -> Path:
    """A random Qwen3_5MoeForConditionalGeneration (vision tower included) saved by transformers, plus the mtp.*
    tensors the published checkpoints carry (transformers' class has none)."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    from moeserve.bench.checkpoints import randomize_zero_inits

    config = Qwen3_5MoeConfig(text_config=TINY_QWEN35_TEXT, vision_config=dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64))
    torch.manual_seed(0)
    model = Qwen3_5MoeForConditionalGeneration(config).eval()
    randomize_zero_inits(model)
    model.save_pretrained(folder)
    state = load_file(folder / "model.safetensors")
    state |= {"mtp.fc.weight": torch.randn(64, 128), "mtp.layers.0.input_layernorm.weight": torch.randn(64),
              "mtp.norm.weight": torch.randn(64)}
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_qwen35_serves_the_language_model_only(tmp_path: Path) -> None:
    from transformers import Qwen3_5MoeForConditionalGeneration

    from moeserve.models.experts.plans import expert_plan
    from moeserve.models.inventory import resident_nbytes

    folder = write_tiny_qwen35(tmp_path / "qwen35")
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    ref = Qwen3_5MoeForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    assert_matches_transformers(folder, ref, long_prompts(4))
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32")
    e = llm.engine
    assert "the vision tower" in e.choices["not loaded: model.visual.*"]
    assert "multi-token-prediction" in e.choices["not loaded: mtp.*"] and "(3 tensors" in e.choices["not loaded: mtp.*"]
    plan = expert_plan(e.checkpoint, e.arch, e.spec, torch.float32)
    assert resident_nbytes(e.checkpoint, plan, torch.float32) == e.model.resident_bytes
    tensors = e.checkpoint.tensors
    assert any(n.startswith("model.visual.") for n in tensors)
    language = sum(r.nbytes for n, r in tensors.items() if n.startswith(("model.language_model.", "lm_head"))
                   and ".mlp.experts." not in n)
    assert e.model.resident_bytes == language  # fp32 as stored: every non-expert language tensor, nothing else
    e.close()


def test_a_step_too_small_for_a_prompt_chunk_is_refused(tiny_checkpoint) -> None:
    from moeserve.errors import ConfigError

    with pytest.raises(ConfigError, match=r"chunks of 64 positions.*set at least 72") as err:
        LLM(str(tiny_checkpoint("qwen3_next")), skip_tokenizer_init=True, max_num_batched_tokens=40)
    assert "\n" not in str(err.value)


def write_tiny_qwen35_text(folder: Path, dtype: torch.dtype = torch.float32) -> Path:
    """A random Qwen3_5MoeForCausalLM (the text-only class: flat config.json, model.layers.*) saved by transformers,
    plus an mtp.* tensor as the published checkpoints carry."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    from moeserve.bench.checkpoints import randomize_zero_inits

    torch.manual_seed(1)
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**TINY_QWEN35_TEXT)).to(dtype).eval()
    randomize_zero_inits(model)
    model.save_pretrained(folder)
    state = load_file(folder / "model.safetensors") | {"mtp.norm.weight": torch.randn(64).to(dtype)}
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_qwen35_text_only_class_matches_transformers(tmp_path: Path) -> None:
    """Qwen3_5MoeForCausalLM (refused before): fp32 tokens and log-probabilities of transformers' own class, the
    same spec as the conditional-generation class of the same text config, mtp.* not loaded."""
    from transformers import Qwen3_5MoeForCausalLM

    folder = write_tiny_qwen35_text(tmp_path / "qwen35-text")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5MoeForCausalLM"] and "text_config" not in config
    spec = get_architecture(config, "config.json").spec(config, "config.json")
    wrapped = {**QWEN35_35B, "text_config": config}
    want = get_architecture(wrapped, "config.json").spec(wrapped, "config.json")
    assert spec == replace(want, architecture="Qwen3_5MoeForCausalLM")
    ref = Qwen3_5MoeForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    choices = assert_matches_transformers(folder, ref, X.random_prompts(5, (70, 9)))
    assert "multi-token-prediction" in choices["not loaded: mtp.*"]
