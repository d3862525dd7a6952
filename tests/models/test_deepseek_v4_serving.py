"""DeepSeek-V4 served (models/mixers/compressed_mixer.py, models/layers/mhc_layer.py) on tiny checkpoints transformers
writes (tests/fixtures/deepseek_v4.py TINY: a sliding, two compressed sparse and a heavily compressed layer, a
hash-routed layer, two streams): fp32 greedy tokens and logprobs against transformers' own forward, and in the
default bf16 offloaded == resident, chunked == one pass, prefix hit == miss, batched and preempted == alone, bit for
bit.

Ties: transformers' indexer takes torch.topk of its scores, which picks either of two equal ones; moeserve the
earlier entry. The checkpoint has 16 indexer heads (a score of exactly 0, the usual tie, needs all 16 relu(q . k)
at 0) and the reference run counts the queries with a tie at the cut: none (`index_ties`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.fixtures.deepseek_v4 import write_tiny_deepseek_v4, write_tiny_shipped
from tests.models.exactness import (
    assert_batched_and_preempted_equal_solo,
    assert_chunked_equals_one_pass,
    assert_matches_transformers,
    assert_offloaded_equals_resident,
    assert_prefix_hit_equals_cold,
    random_prompts,
    run_alone,
    run_together,
)
from tests.models.test_deepseek_v32 import index_ties

PROMPTS = random_prompts(3, (30, 7, 21), vocab=128)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deepseek_v4")
    return {"float32": write_tiny_deepseek_v4(root / "fp32", torch.float32),
            "bfloat16": write_tiny_deepseek_v4(root / "bf16", torch.bfloat16)}


def test_greedy_tokens_and_logprobs_match_transformers(tiny: dict[str, Path]) -> None:
    """Three prompts decoded together (30 tokens: 7 windows of 4 and 3 of 8 closed, the indexer choosing 4 of up to
    9 entries, the window of 8 sliding), kernels=torch: transformers' tokens, logprobs within 1e-4."""
    from transformers import DeepseekV4ForCausalLM

    ref = DeepseekV4ForCausalLM.from_pretrained(tiny["float32"], dtype=torch.float32).eval()
    with index_ties(ref) as counts:
        choices = assert_matches_transformers(tiny["float32"], ref, PROMPTS, kernels="torch", max_model_len=256)
    assert counts[0] > 0 and counts[1] == 0, counts  # the indexer chose among more entries than it keeps; no tie
    assert "compressed entries" in choices["compressed attention"]  # the start-up line of its layers


def test_bf16_offloaded_chunked_prefix_hit_batched_equal_resident(tiny: dict[str, Path]) -> None:
    folder = tiny["bfloat16"]
    resident = run_together(folder, PROMPTS)
    assert_offloaded_equals_resident(folder, PROMPTS, resident, units=4)
    assert_chunked_equals_one_pass(folder, PROMPTS[0], (16,))
    assert_prefix_hit_equals_cold(folder, PROMPTS[0], PROMPTS[0][:16] + PROMPTS[2], shared=16)
    solo = run_alone(folder, PROMPTS, max_model_len=64)
    assert_batched_and_preempted_equal_solo(folder, [(0, PROMPTS[0]), (0, PROMPTS[1]), (2, PROMPTS[2])], kv_blocks=5,
                                            steps=6, max_model_len=64, solo=solo)


def test_shipped_formats_serve_offloaded_as_resident(tmp_path: Path) -> None:
    """As DeepSeek-V4-Flash ships (E8M0-scaled FP8 Linears dequantized at load, MXFP4 experts kept so in every tier
    and dequantized at use): 4 expert slots give the all-resident run's logits and tokens bit for bit."""
    folder = write_tiny_shipped(tmp_path / "shipped")
    resident = run_together(folder, PROMPTS[:2])
    assert "mxfp4-deepseek" in resident.choices["experts"]
    assert_offloaded_equals_resident(folder, PROMPTS[:2], resident, units=4)
