"""Offloaded == resident, bit for bit, in bf16 with the default thread count, at real dimensions (hidden >= 2048,
expert width >= 768: every kernel takes several blocks per row and several threads per op).

tests/test_offload.py runs the wide matrix (every policy and cache size, every quantized format) in float32 on tiny
models, where the ops take one block; this one runs where the roundings of two ops would differ. For every
architecture and every expert-compute path (the default choices, the plain layout with the per-op step, the torch
kernels; int8 for one model, MXFP4 for gpt-oss), the resident run is the reference and offloaded runs vary the cache (one unit, three,
half the experts), the policy and prefetch. Every engine step's logits must be `torch.equal`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moeserve.bench.real_dims import REAL_DIMS
from moeserve.engine.llm import LLM
from moeserve.engine.sampling_params import SamplingParams
from tests.logits_capture import generate_capturing_logits

pytestmark = pytest.mark.slow

PROMPTS = [{"prompt_token_ids": [3, 17, 42, 9, 250, 1000, 77, 5, 4000, 12]}, {"prompt_token_ids": [11, 5, 77]}]
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)
# name -> settings: the defaults (interleaved layout, fused decode step where they apply), the plain layout run op
# by op, and torch's kernels
PATHS: dict[str, dict] = {
    "default": {},
    "plain-per_op": {"expert_layout": "plain", "decode_step": "per_op"},
    "torch": {"kernels": "torch"},
}
# (cache in units: 1 = below top-k, 3, or "half"; policy; prefetch)
OFFLOADS = [(1, "lru", False), (3, "lfru", True), ("half", "lfu", False)]


@pytest.fixture
def real_checkpoint(real_dims_checkpoint):
    return real_dims_checkpoint  # written once per session, shared with the other real-dims suites (conftest.py)


def run(folder: Path, **settings):
    llm = LLM(str(folder), skip_tokenizer_init=True, max_model_len=64, **settings)
    store = llm.engine.model.store
    logits, outs = generate_capturing_logits(llm, PROMPTS, PARAMS)
    return logits, [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], store


def check_offloads(folder: Path, label: str, **settings) -> None:
    ref_logits, ref_outs, store = run(folder, **settings)
    assert store.resident
    unit, total = store.unit_nbytes, store.total_experts
    for units, policy, prefetch in OFFLOADS:
        n = total // 2 if units == "half" else units
        logits, outs, off = run(folder, expert_cache_gb=n * unit / 2**30 * 1.001, cache_policy=policy,
                                prefetch=prefetch, **settings)
        where = f"{label}, {n} of {total} units, {policy}, prefetch={prefetch}"
        assert not off.resident and off.stats.misses > 0, where
        assert len(logits) == len(ref_logits), where
        for step, (a, b) in enumerate(zip(logits, ref_logits)):
            assert a.dtype == b.dtype and torch.equal(a, b), f"{where}: logits differ at step {step}"
        assert outs == ref_outs, where


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("name", list(REAL_DIMS))
def test_offloaded_equals_resident_bf16_real_dims(real_checkpoint, name: str, path: str) -> None:
    check_offloads(real_checkpoint(name), f"{name} {path}", **PATHS[path])


def test_offloaded_equals_resident_int8_real_dims(real_checkpoint) -> None:
    check_offloads(real_checkpoint("Qwen3-30B-A3B"), "Qwen3-30B-A3B int8", quantization="int8")


def test_offloaded_equals_resident_mxfp4_real_dims(real_checkpoint) -> None:
    """gpt-oss experts stored in MXFP4 (the real checkpoints' format): units stay MXFP4 in every tier."""
    check_offloads(real_checkpoint("gpt-oss-20b-mxfp4"), "gpt-oss-20b MXFP4")
