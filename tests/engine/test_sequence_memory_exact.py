"""The paged sequence memory never changes a number: for every architecture, resident and offloaded, in bf16 (real
dimensions: every kernel takes several blocks) and fp32, the logits of every sampled step are `torch.equal` across

- block size 16 (the default) and one block per sequence (block_size 1024: the old slot layout's shape);
- chunked prefill (max_num_batched_tokens 20: chunks that end mid-block) and unchunked;
- a prefix-cache hit (the same prompt again: 4 of its 5 blocks taken from the cache) and a miss;
- a sequence preempted mid-decode (its blocks freed, recomputed from its tokens) and one never preempted.
"""

from __future__ import annotations

import random

import pytest
import torch

from moeserve.bench.real_dims import VOCAB
from moeserve.engine.llm import LLM
from moeserve.engine.sampling_params import SamplingParams
from moeserve.state.kv_cache import fixed_pool_bytes

pytestmark = pytest.mark.slow

MODELS = ("Qwen3-30B-A3B", "Qwen1.5-MoE-A2.7B", "OLMoE-1B-7B", "Mixtral-8x7B", "gpt-oss-20b", "GLM-4.5-Air")
MAX_TOKENS = 4
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)


@pytest.fixture
def real_checkpoint(real_dims_checkpoint):
    return real_dims_checkpoint  # written once per session, shared with the other real-dims suites (conftest.py)


def sampled_logits(llm: LLM, prompt: list[int]) -> tuple[list[torch.Tensor], list]:
    """The logits of each step that sampled this (only) request's token, and its (tokens, logprobs)."""
    engine = llm.engine
    rows: list[torch.Tensor] = []
    forward = engine.model.forward

    def capture(batch, kv):  # noqa: ANN001, ANN202
        out = forward(batch, kv)
        rows.append(out.clone())
        return out

    engine.model.forward = capture
    try:
        out = llm.generate([{"prompt_token_ids": prompt}], PARAMS)[0].outputs[0]
    finally:
        engine.model.forward = forward
    return rows[-MAX_TOKENS:], [out.token_ids, out.logprobs]


def assert_same(got: list[torch.Tensor], ref: list[torch.Tensor], what: str) -> None:
    assert len(got) == len(ref), what
    for step, (a, b) in enumerate(zip(got, ref)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{what}: logits differ at step {step}"


@pytest.fixture(scope="module")
def unit_nbytes() -> dict[tuple[str, str], int]:
    """(model, dtype) -> bytes of one expert unit, noted by the resident run (collected just before the offloaded
    one): the offloaded run sizes its cache from it instead of loading a resident engine only to ask."""
    return {}


# bf16 (the default) resident and offloaded; fp32 resident: what an fp32 run adds is its own kernels, and the
# offloaded runs show the store changes nothing (fp32 offloaded cost ~1 minute of CI for no other path)
@pytest.mark.parametrize(("dtype", "offloaded"), [("bfloat16", False), ("bfloat16", True), ("float32", False)],
                         ids=["bfloat16-resident", "bfloat16-offloaded", "float32-resident"])
@pytest.mark.parametrize("name", MODELS)
def test_block_size_chunking_prefix_hits_and_preemption_change_no_logit(real_checkpoint, unit_nbytes, name: str,
                                                                          dtype: str, offloaded: bool) -> None:
    folder = real_checkpoint(name)
    rng = random.Random(f"{name}-{dtype}")
    prompt = [rng.randrange(VOCAB) for _ in range(75)]
    settings = {"skip_tokenizer_init": True, "max_model_len": 128, "dtype": dtype}
    if offloaded and (name, dtype) not in unit_nbytes:  # run alone (-k): ask a resident engine
        resident = LLM(str(folder), **settings)
        unit_nbytes[name, dtype] = resident.engine.model.store.unit_nbytes
        resident.engine.close()
    if offloaded:
        settings["expert_cache_gb"] = 3 * unit_nbytes[name, dtype] / 2**30 * 1.001
    probe = LLM(str(folder), **settings)
    unit_nbytes[name, dtype] = probe.engine.model.store.unit_nbytes
    if offloaded:
        assert not probe.engine.model.store.resident
    engine = probe.engine
    try:
        ref, ref_out = sampled_logits(probe, prompt)  # block 16, unchunked, a prefix-cache miss
        assert engine.memory.stats.hit_tokens == 0

        hit, hit_out = sampled_logits(probe, prompt)
        assert engine.memory.stats.hit_tokens == 64, "the second run takes 4 full blocks from the prefix cache"
        assert_same(hit, ref, f"{name} {dtype}: prefix hit")

        engine.memory.prefix_caching = False  # chunks of 20 tokens, computed again from the first token
        engine.scheduler.max_num_batched_tokens = 20
        chunked, chunked_out = sampled_logits(probe, prompt)
        assert engine.scheduler.stats.last_step_tokens == 1 and engine.memory.stats.hit_tokens == 64
        assert_same(chunked, ref, f"{name} {dtype}: chunked prefill")
        assert hit_out == ref_out == chunked_out
    finally:
        engine.close()

    whole = LLM(str(folder), block_size=1024, **settings)  # one block per sequence: the slot cache's shape
    try:
        one_block, _ = sampled_logits(whole, prompt)
        assert whole.engine.kv.num_blocks[0] >= 1 and whole.engine.kv.block_size == 1024
    finally:
        whole.engine.close()
    assert_same(one_block, ref, f"{name} {dtype}: block size 1024 vs 16")


@pytest.mark.parametrize("name", ["Qwen3-30B-A3B", "gpt-oss-20b"])
def test_preempted_sequences_finish_with_their_solo_tokens(real_checkpoint, name: str) -> None:
    """A pool of 12 blocks (16 tokens each) for 4 sequences of 40-token prompts generating 30 tokens: they cannot
    all hold their blocks, so the newest are preempted (freed, recomputed later) again and again. Each finishes
    with the tokens and logprobs it gets alone (bf16, default settings otherwise)."""
    folder = real_checkpoint(name)
    rng = random.Random(name)
    prompts = [[rng.randrange(VOCAB) for _ in range(40)] for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2)
    llm = LLM(str(folder), skip_tokenizer_init=True, max_model_len=128, enable_prefix_caching=False)
    try:
        solo = [llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0] for p in prompts]
    finally:
        llm.engine.close()
    e = llm.engine
    fixed, per_token = fixed_pool_bytes(e.kv_groups, e.plan.block_bytes, 16, 8, e.max_num_batched_tokens, 128)
    tight = LLM(str(folder), skip_tokenizer_init=True, max_model_len=128, enable_prefix_caching=False,
                kv_cache_gb=(fixed + 12 * 16 * per_token) / 2**30)
    try:
        full = [n for g, n in zip(tight.engine.kv_groups, tight.engine.kv.num_blocks) if g.kind.name == "full attention"]
        assert full == [12]
        together = tight.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert tight.engine.scheduler.stats.preemptions > 0, "the pool was meant to be too small for all four"
    finally:
        tight.engine.close()
    for i, (a, b) in enumerate(zip(together, solo)):
        assert a.outputs[0].token_ids == b.token_ids and a.outputs[0].logprobs == b.logprobs, f"request {i}"
