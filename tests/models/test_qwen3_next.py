"""Qwen3-Next (Qwen3NextForCausalLM) and Qwen3.5 MoE (Qwen3_5MoeForConditionalGeneration): Gated DeltaNet hybrids.

- The specs of the published configs (layer pattern, linear-attention shapes, gated attention, zero-centred norms).
- Tiny checkpoints transformers writes (3 linear-attention layers + 1 full, shared expert, zero-centred norm weights
  randomized), fp32: transformers' greedy tokens and log-probabilities within 1e-4, with prompts longer than two
  chunks of the chunk form, decoded together; the C++ kernels and torch alike.
- bf16, default settings: a prompt prefilled in chunks gives the logits of one pass bit for bit; sequences batched
  and preempted (recomputed) finish with their solo tokens and logprobs; offloaded experts == resident.
- Qwen3.5: the language model under model.language_model.* served, the vision tower and mtp.* never read (logged,
  out of the resident size); transformers' greedy tokens in fp32.
- Qwen3-Next's real dimensions truncated to 4 layers (3 linear + 1 full) and 12 of its 512 experts (slow): fp32
  greedy tokens and log-probabilities within 1e-4 against transformers, bf16 offloaded == resident.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeserve import LLM, SamplingParams
from moeserve.models.registry import get_architecture
from moeserve.state.kv_cache import fixed_pool_bytes
from tests.engine.test_parity_transformers import hf_greedy, hf_model
from tests.logits_capture import generate_capturing_logits

STEPS = 6
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
    rng = random.Random(seed)
    return [[rng.randrange(300) for _ in range(n)] for n in (150, 5, 70)]


def assert_matches_transformers(folder: Path, ref_model, prompts: list[list[int]], **settings) -> None:  # noqa: ANN001
    """fp32, prompts decoded together: transformers' greedy tokens, log-probabilities within 1e-4."""
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", **settings)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=3))
    llm.engine.close()
    for prompt, out in zip(prompts, outs):
        ref_tokens, ref_logps = hf_greedy(ref_model, prompt, STEPS)
        assert out.outputs[0].token_ids == ref_tokens, f"prompt of {len(prompt)} tokens"
        for lp, ref in zip(out.outputs[0].logprobs, ref_logps):
            for token_id, entry in lp.items():
                assert abs(entry.logprob - float(ref[token_id])) < 1e-4, (len(prompt), token_id)


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_tiny_qwen3_next_matches_transformers(tiny_checkpoint, kernels: str) -> None:
    folder = tiny_checkpoint("qwen3_next")
    assert_matches_transformers(folder, hf_model(folder, torch.float32), long_prompts(), kernels=kernels)


def every_step(folder: Path, prompts: list[list[int]], **settings) -> tuple[list[torch.Tensor], list]:
    """Default settings (bf16 from the checkpoint): the logits of every engine step, and (tokens, logprobs) of
    each prompt."""
    llm = LLM(str(folder), skip_tokenizer_init=True, max_model_len=512, **settings)
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=2)
    logits, outs = generate_capturing_logits(llm, [{"prompt_token_ids": p} for p in prompts], params)
    return logits, [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def sampled_logits(folder: Path, prompts: list[list[int]], **settings) -> tuple[list[torch.Tensor], list]:
    """`every_step`'s logits of the steps after the prompts only, and the outputs."""
    logits, outs = every_step(folder, prompts, **settings)
    return logits[-(STEPS - 1):], outs


def test_chunked_prefill_equals_one_pass_bit_for_bit(tiny_checkpoint) -> None:
    """A 200-token prompt in one step and in chunks of 64 (the scheduler cuts on the chunk grid): the same bits."""
    folder = tiny_checkpoint("qwen3_next", dtype="bfloat16")
    prompt = long_prompts(1)[0] + long_prompts(2)[2][:50]
    whole, whole_out = every_step(folder, [prompt])
    chunked, chunked_out = every_step(folder, [prompt], max_num_batched_tokens=80)
    assert (len(whole), len(chunked)) == (STEPS, STEPS + 2)  # 200 tokens: 64 + 64 + 72 (the end)
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked[2:])) and whole_out == chunked_out
    assert whole[0].dtype == torch.float32


def test_batched_and_preempted_sequences_keep_their_solo_numbers(tiny_checkpoint) -> None:
    """Four sequences in a full-attention pool of 12 blocks: preempted and recomputed (output tokens by the
    recurrent step again) again and again; each ends with the tokens and logprobs it gets alone (bf16)."""
    folder = tiny_checkpoint("qwen3_next", dtype="bfloat16")
    rng = random.Random(7)
    prompts = [[rng.randrange(300) for _ in range(40)] for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2)
    llm = LLM(str(folder), skip_tokenizer_init=True, max_model_len=128)
    assert "prefix caching off (recurrent state layers" in llm.engine.choices["KV cache"]
    solo = [llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0] for p in prompts]
    e = llm.engine
    e.close()
    fixed, per_token = fixed_pool_bytes(e.kv_groups, e._block_bytes, 16, 8, e.max_num_batched_tokens, 128)
    tight = LLM(str(folder), skip_tokenizer_init=True, max_model_len=128, kv_cache_gb=(fixed + 12 * 16 * per_token) / 2**30)
    together = tight.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert tight.engine.scheduler.stats.preemptions > 0, "the pool was meant to be too small for all four"
    tight.engine.close()
    for i, (a, b) in enumerate(zip(together, solo)):
        assert a.outputs[0].token_ids == b.token_ids and a.outputs[0].logprobs == b.logprobs, f"request {i}"


def test_offloaded_equals_resident_in_bf16(tiny_checkpoint) -> None:
    folder = tiny_checkpoint("qwen3_next", dtype="bfloat16")
    prompts = long_prompts(3)
    ref, ref_out = sampled_logits(folder, prompts)
    probe = LLM(str(folder), skip_tokenizer_init=True, max_model_len=512)
    unit = probe.engine.model.store.unit_nbytes
    assert "Gated DeltaNet" in probe.engine.choices["decode step"]  # the fused step refuses it, logged
    assert "3 layers" in probe.engine.choices["linear attention"]
    if probe.engine.cpp_kernels:
        assert "C++ gated_delta_step_" in probe.engine.choices["linear attention"]
    probe.engine.close()
    got, got_out = sampled_logits(folder, prompts, expert_cache_gb=3 * unit / 2**30 * 1.001)
    assert all(torch.equal(a, b) for a, b in zip(got, ref)) and got_out == ref_out


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

    from tests.models.checkpoints import randomize_zero_inits

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

    from moeserve.models.expert_plans import expert_plan
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


# ------------------------------------------------------------------------------------------- real dimensions
def write_qwen3_next_real_dims(folder: Path) -> Path:
    """Qwen3-Next-80B-A3B's dimensions, 4 layers (3 Gated DeltaNet + 1 gated full attention), 12 of its 512
    experts (top-10 kept), a 4096-token vocabulary; random init, bf16, saved by transformers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.models.checkpoints import randomize_zero_inits

    fields = {k: v for k, v in QWEN3_NEXT_80B.items() if k not in ("architectures", "model_type", "torch_dtype",
                                                                     "rope_scaling")}
    config = AutoConfig.for_model("qwen3_next", **{**fields, "num_hidden_layers": 4, "num_experts": 12,
                                                   "vocab_size": 4096, "max_position_embeddings": 4096,
                                                   "initializer_range": 0.04})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    randomize_zero_inits(model)
    model.save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_real_dims_match_transformers_in_fp32_and_offload_exactly_in_bf16(tmp_path: Path) -> None:
    """fp32: transformers' greedy tokens, log-probabilities within 1e-4 (measured: 1.2e-5 and 1.7e-5). bf16 (the
    checkpoint's dtype, default settings): offloaded experts (3 slots) give the resident run's logits bit for bit.
    (In bf16 this random model's top tokens lie within 0.03 of each other, so the two engines' bf16 roundings pick
    different ones at the first step: fp32 is where the arithmetic is compared.)"""
    folder = write_qwen3_next_real_dims(tmp_path / "qwen3_next")
    prompts = [[3, 17, 42, 9, 250, 1000, 77, 5, 4000, 12] * 8, [11, 5, 77]]
    assert_matches_transformers(folder, hf_model(folder, torch.float32), prompts, max_model_len=512)
    resident, outs = sampled_logits(folder, prompts)
    probe = LLM(str(folder), skip_tokenizer_init=True, max_model_len=512)
    unit = probe.engine.model.store.unit_nbytes
    probe.engine.close()
    offloaded, off_outs = sampled_logits(folder, prompts, expert_cache_gb=3 * unit / 2**30 * 1.001)
    assert all(torch.equal(a, b) for a, b in zip(offloaded, resident)) and off_outs == outs


def test_a_step_too_small_for_a_prompt_chunk_is_refused(tiny_checkpoint) -> None:
    from moeserve.errors import ConfigError

    with pytest.raises(ConfigError, match=r"chunks of 64 positions.*set at least 72") as err:
        LLM(str(tiny_checkpoint("qwen3_next")), skip_tokenizer_init=True, max_num_batched_tokens=40)
    assert "\n" not in str(err.value)
