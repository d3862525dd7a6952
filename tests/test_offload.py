"""Offloaded == resident, bit for bit: for every architecture, cache size, eviction policy and prefetch setting,
the logits of every engine step are `torch.equal` to the all-resident run (and so are tokens and logprobs).

Cache sizes (the tiny models have 8 experts per MoE layer, top-k 2): a quarter of all experts; 3 experts (fewer
than a prefill step's layer needs, so layers run in several chunks); a few KB (one expert, less than top-k).
The static policy pins from the routing trace the resident run recorded (--record-trace).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moeserve.bench.checkpoints import ARCHS
from moeserve.engine.llm import LLM
from moeserve.engine.sampling_params import SamplingParams
from moeserve.experts.traces.moetrace import read_trace
from tests.logits_capture import generate_capturing_logits

PROMPTS = [{"prompt_token_ids": [3, 17, 42, 9, 250]}, {"prompt_token_ids": [11, 5, 77]}]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
FEW_KB = 4e-6  # GiB: ~4 KB, less than one expert unit (24 KB) -> the store keeps its minimum of one slot
POLICIES = ("lru", "lfu", "lfru", "static")


def run(folder: Path, **settings):
    """(per-step logits, token ids per prompt, logprobs per prompt, store stats) of a greedy run."""
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", threads=1, **settings)
    logits, outs = generate_capturing_logits(llm, PROMPTS, PARAMS)
    engine = llm.engine
    return (logits, [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs],
            engine.model.store)


@pytest.fixture(scope="module")
def reference(tiny_checkpoint, tmp_path_factory):
    """Per architecture: the resident run (which also records the routing trace the static policy pins from)."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            folder = tiny_checkpoint(arch)
            trace = tmp_path_factory.mktemp(f"trace_{arch}") / "routing.trace"
            logits, tokens, logprobs, store = run(folder, record_trace=str(trace))
            assert store.resident
            cache[arch] = (folder, trace, logits, tokens, logprobs, store.unit_nbytes, store.total_experts)
        return cache[arch]

    return get


def check_identical(reference, arch: str, cache: str, policy: str, prefetch: bool) -> None:
    folder, trace, ref_logits, ref_tokens, ref_logprobs, unit_nbytes, total = reference(arch)
    experts = {"quarter": total // 4, "three": 3}.get(cache)
    gb = FEW_KB if experts is None else experts * unit_nbytes / 2**30
    extra = {"cache_trace": str(trace)} if policy == "static" else {}
    logits, tokens, logprobs, store = run(folder, expert_cache_gb=gb, cache_policy=policy, prefetch=prefetch,
                                          **extra)
    assert not store.resident and store.capacity == (experts or 1)
    assert store.stats.misses > 0  # the run really went through the slower tier
    assert len(logits) == len(ref_logits)
    for step, (a, b) in enumerate(zip(logits, ref_logits)):
        assert torch.equal(a, b), f"{arch} cache={cache} {policy} prefetch={prefetch}: logits differ at step {step}"
    assert tokens == ref_tokens and logprobs == ref_logprobs


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cache", ["quarter", "three", "few_kb"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("prefetch", [False, True])
def test_offloaded_equals_resident(reference, arch, cache, policy, prefetch):
    check_identical(reference, arch, cache, policy, prefetch)


def test_record_trace_holds_every_step_and_layer(reference):
    folder, trace_path, ref_logits, *_ = reference("qwen3_moe")
    trace = read_trace(trace_path)
    steps = trace.steps()
    assert len(steps) == len(ref_logits)  # one END_STEP per engine step
    assert trace.header.moe_layers == (0, 2)  # layer 1 of the tiny Qwen3 is dense
    first = steps[0]
    assert [r.layer for r in first] == [0, 2]
    assert first[0].topk_ids.shape == (8, 2)  # prefill of 5 + 3 tokens, top-2


def test_prefetch_records_its_guesses_in_the_trace(tiny_checkpoint, tmp_path):
    folder = tiny_checkpoint("qwen3_moe")
    path = tmp_path / "with_guesses.trace"
    run(folder, expert_cache_gb=FEW_KB * 20, prefetch=True, record_trace=str(path))
    steps = read_trace(path).steps()
    guesses = [r for step in steps for r in step if r.predicted is not None]
    assert guesses and all(r.layer == 0 and r.predicted_layer == 2 for r in guesses)
