"""The CUDA path of the store (pinned staging, side-stream copies, host tier): offloaded == resident on the GPU.

Skipped without a CUDA device; the same event discipline is exercised on CPU with a recording fake in
test_transfer.py and with an asynchronous one (streams run by threads, a missing wait gives wrong data) in
test_async_fast_tier.py.
"""

from __future__ import annotations

import pytest
import torch

from moeserve.engine.llm import LLM
from moeserve.engine.sampling_params import SamplingParams

PROMPTS = [{"prompt_token_ids": [3, 17, 42, 9, 250]}, {"prompt_token_ids": [11, 5, 77]}]
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def logits_of(folder, **settings) -> tuple[list[torch.Tensor], str]:
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", device="cuda", **settings)
    engine, seen = llm.engine, []
    forward = engine.model.forward
    engine.model.forward = lambda b, kv: (seen.append(forward(b, kv).cpu()), seen[-1])[1]  # type: ignore[method-assign]
    llm.generate(PROMPTS, PARAMS)
    describe = engine.model.store.describe()
    engine.close()
    return seen, describe


@pytest.mark.gpu
@pytest.mark.parametrize("host_cache_gb", [0.0, 1e-4])
@pytest.mark.parametrize("prefetch", [False, True])
def test_gpu_offloaded_equals_resident(tiny_checkpoint, host_cache_gb, prefetch):
    folder = tiny_checkpoint("qwen3_moe")
    ref, _ = logits_of(folder)
    got, describe = logits_of(folder, expert_cache_gb=3 * 24576 / 2**30, host_cache_gb=host_cache_gb,
                              prefetch=prefetch)
    assert "transfers:" in describe
    assert len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref))
