"""Gemma-4 26B-A4B's text model (Gemma4ForCausalLM, and Gemma4ForConditionalGeneration's language model).

- The spec and parameter counts of a 26B-A4B config.json (PUBLISHED_26B_A4B: no published config.json was found
  offline; see its comment for where each field comes from), within 2% of Google's published 25.2B total / 3.8B
  active; `moeserve plan` places it at 24 and 64 GB from the config alone.
- Tiny checkpoints transformers writes (tests/fixtures/gemma4.py: sliding and global layers, keys as values,
  proportional rotary, GeGLU experts beside a dense MLP, scaled router, soft-capped logits, every ones-init weight
  randomised): fp32 tokens equal to transformers' and logprobs within 1e-4, C++ kernels and torch; the multimodal
  wrapper's language model the same, its vision tower not loaded; in bf16 offloaded == resident, chunked == one
  pass, batched and preempted == alone, a prefix-cache hit == a cold run, bit for bit.
- The Gemma-4 variants not served are refused in one line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from moeserve.cli import main
from moeserve.errors import UnsupportedModelError
from moeserve.models.config_only import parameter_counts
from moeserve.models.registry import get_architecture
from tests.fixtures.gemma4 import write_tiny_gemma4, write_tiny_gemma4_vl
from tests.models import exactness as X

# Gemma-4-26B-A4B's text config as transformers' Gemma4TextConfig reads it. Where each field comes from (no
# published config.json was found offline): 30 layers, 16 heads, 8 KV heads of 256, sliding window 1024, vocabulary
# 262144, 128 experts of width 704 (top-8), a dense MLP of 2112, 262144 positions: the model card's figures as
# apxml.com and vast.ai list them; 2 KV heads in the global layers: transformers 5.24's Gemma4TextConfig EP-plan
# comment ("num_global_key_value_heads=2"); global head_dim 512, the rotary parameters, the 5:1 layer pattern, keys
# as values: transformers' defaults and the model card's "unified Keys and Values on global layers"; hidden size 2816
# and the soft cap 30: the published config.json as remembered (not found offline). Cross-check: these give the
# 210 KiB of keys and values per token colaberry.ai lists (sliding K and V, global K once).
PUBLISHED_26B_A4B: dict[str, Any] = dict(
    architectures=["Gemma4ForCausalLM"], model_type="gemma4_text", vocab_size=262144, hidden_size=2816,
    intermediate_size=2112, num_hidden_layers=30, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
    global_head_dim=512, num_global_key_value_heads=2, attention_k_eq_v=True, sliding_window=1024,
    enable_moe_block=True, num_experts=128, top_k_experts=8, moe_intermediate_size=704, hidden_size_per_layer_input=0,
    final_logit_softcapping=30.0, max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=True,
    hidden_activation="gelu_pytorch_tanh", dtype="bfloat16",
)
# Google's model card (huggingface.co/google/gemma-4-26B-A4B-it, as vast.ai, llmradar.eu and colaberry.ai quote it):
# "25.2B total parameters", "3.8B active" - counted with the embedding table (3.1B without it); the vision encoder
# (~550M) is not in them
PUBLISHED_TOTAL, PUBLISHED_ACTIVE = 25.2e9, 3.8e9


def test_spec_and_parameters_of_the_26b_a4b_config() -> None:
    spec = get_architecture(PUBLISHED_26B_A4B, "config.json").spec(PUBLISHED_26B_A4B, "config.json")
    a, o, m = spec.attention, spec.attention_override, spec.moe
    assert o is not None and o.layers == (5, 11, 17, 23, 29)
    assert (a.num_heads, a.num_kv_heads, a.head_dim, a.softmax_scale, a.v_norm) == (16, 8, 256, 1.0, True)
    assert a.sliding_window.count(1024) == 25 and not a.k_eq_v
    g = o.attention
    assert (g.num_kv_heads, g.head_dim, g.k_eq_v, o.rope.rope_type, o.rope.theta) == (2, 512, True, "proportional", 1e6)
    assert (m.routing, m.expert_kind, m.top_k, m.num_experts) == ("normed_softmax_topk", "geglu", 8, 128)
    assert spec.logit_softcap == 30.0 and spec.embed_scale == 2816**0.5 and spec.tie_word_embeddings
    counts = parameter_counts(get_architecture(PUBLISHED_26B_A4B, ""), spec)
    assert abs(counts.total / PUBLISHED_TOTAL - 1) < 0.02, counts.total
    assert abs(counts.active / PUBLISHED_ACTIVE - 1) < 0.02, counts.active


def _plan(capsys: pytest.CaptureFixture, path: Path, memory_gb: str) -> list[str]:
    code = main(["plan", str(path), "--memory-gb", memory_gb, "--device", "cpu", "--no-probe"])
    captured = capsys.readouterr()
    return [f"exit {code}", *(captured.out + captured.err).splitlines()]


def test_plan_places_26b_a4b_at_24_and_64_gb(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """From config.json alone (bf16, 50 GB of weights): at 24 GB the experts are offloaded (a share cached in RAM,
    the rest read from disk); at 64 GB every expert is resident."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(PUBLISHED_26B_A4B))
    for memory_gb, resident in (("24", False), ("64", True)):
        lines = _plan(capsys, path, memory_gb)
        placement = next(line for line in lines if line.startswith("placement:"))
        assert lines[0] == "exit 0", lines
        held = int(placement.split()[1])
        assert (held == 30 * 128) == resident and held > 0, placement


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gemma4(tmp_path_factory.mktemp("gemma4"))


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_fp32_matches_transformers(tiny: Path, kernels: str) -> None:
    from tests.engine.test_parity_transformers import hf_model

    choices = X.assert_matches_transformers(tiny, hf_model(tiny, torch.float32), X.random_prompts(0, (23, 5)),
                                            kernels=kernels)
    assert "GeGLU" in choices["experts"] and "1 KV heads of 32" in choices["KV cache"]


def test_multimodal_wrapper_serves_its_language_model(tmp_path: Path) -> None:
    from transformers import Gemma4ForConditionalGeneration

    folder = write_tiny_gemma4_vl(tmp_path / "vl")
    ref = Gemma4ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    choices = X.assert_matches_transformers(folder, ref, X.random_prompts(1, (17,)))
    assert "text input only" in choices["not loaded: model.vision_tower.*"]


def test_bf16_offloaded_chunked_and_batched_are_exact(tmp_path: Path) -> None:
    folder = write_tiny_gemma4(tmp_path / "bf16", torch.bfloat16)
    prompts = X.random_prompts(3, (40, 5, 23))
    X.assert_offloaded_equals_resident(folder, prompts, max_model_len=256)
    X.assert_chunked_equals_one_pass(folder, prompts[0], (16,), max_model_len=256)
    X.assert_batched_and_preempted_equal_solo(folder, [(0, p) for p in X.random_prompts(8, (30, 21, 9))], 6, 12, 64)
    # 32 tokens from the prefix cache: both KV groups (the sliding window's blocks it still reads, the global layers')
    X.assert_prefix_hit_equals_cold(folder, prompts[0], prompts[0][:32] + prompts[2][:9], 32, max_model_len=256)


@pytest.mark.parametrize("field", [dict(hidden_size_per_layer_input=256), dict(num_kv_shared_layers=2),
                                   dict(enable_moe_block=False), dict(use_bidirectional_attention="all")])
def test_variants_not_served_are_refused_in_one_line(field: dict[str, Any]) -> None:
    config = {**PUBLISHED_26B_A4B, **field}
    with pytest.raises(UnsupportedModelError, match=f"{next(iter(field))}.* not supported") as err:
        get_architecture(config, "config.json").spec(config, "config.json")
    assert "\n" not in str(err.value)


def test_a_global_layer_shape_that_does_not_fit_is_refused_in_one_line() -> None:
    from moeserve.errors import CheckpointError
    from moeserve.models.spec import check_spec

    config = {**PUBLISHED_26B_A4B, "num_global_key_value_heads": 3}
    spec = get_architecture(config, "config.json").spec(config, "config.json")
    with pytest.raises(CheckpointError, match=r"num_key_value_heads=3 \(full-attention layers\)") as err:
        check_spec(spec, "config.json")
    assert "\n" not in str(err.value)
