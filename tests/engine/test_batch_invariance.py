"""Batch invariance under default settings: a request's greedy tokens and logprobs (and a seeded sample's) are the
same bits whether it runs alone or beside any other requests, in any batch position, arriving mid-way (its prefill
in the same step as other sequences' decode tokens) or at the start.

Real dimensions (tests/real_dims.py), bf16, default thread count and kernels: every kernel takes several blocks.
"""

from __future__ import annotations

import random

import pytest

from moeserve.bench.real_dims import VOCAB
from moeserve.engine.llm import LLM
from moeserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

# gpt-oss's expert math: the C++ 4-bit/bf16 expert op with kernels=auto, torch's ops in fixed row blocks with torch
MODELS = ("Qwen3-30B-A3B", "Qwen1.5-MoE-A2.7B", "OLMoE-1B-7B", "Mixtral-8x7B", "gpt-oss-20b", "gpt-oss-20b-mxfp4",
          "GLM-4.5-Air")
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=6, ignore_eos=True, logprobs=3, seed=7)


@pytest.fixture
def real_checkpoint(real_dims_checkpoint):
    return real_dims_checkpoint  # written once per session, shared with the other real-dims suites (conftest.py)


def run_schedule(engine, arrivals: list[tuple[int, list[int], SamplingParams]]) -> dict[str, tuple]:
    """Add each (step, prompt, params) when the engine reaches that step; run to the end.
    Returns request id -> (token ids, logprobs) of its only sequence."""
    pending = sorted(enumerate(arrivals), key=lambda x: x[1][0])
    done: dict[str, tuple] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, params) = pending.pop(0)
            engine.add_request(prompt, params, request_id=f"r{i}")
        for out in engine.step():
            if out.finished:
                seq = out.outputs[0]
                done[out.request_id] = (list(seq.token_ids), seq.logprobs)
        step += 1
    return done


# GLM-4.5 with torch's kernels: its noaux_tc routing and shared expert in fixed row blocks
CASES = [(name, "auto") for name in MODELS] + [("Qwen3-30B-A3B", "torch"), ("gpt-oss-20b", "torch"),
                                               ("GLM-4.5-Air", "torch")]
ROUNDS = 3  # random arrival schedules per case
# One schedule where a case costs most and another case covers the same batch-dependent code:
# - gpt-oss MXFP4 differs from gpt-oss-20b's bf16 case (3 rounds) only in decoding its units, which reads the
#   weights alone, never the batch;
# - gpt-oss with torch's ops runs every expert as bf16 GEMMs padded to 16-row blocks: on a CPU without oneDNN's bf16
#   (AVX2) that is minutes per schedule; its fixed-block row math is the same code Qwen3-30B-A3B's torch case runs
#   3 schedules of, the clamped activation is elementwise (row-independent by construction).
ROUNDS_OF = {("gpt-oss-20b-mxfp4", "auto"): 1, ("gpt-oss-20b", "torch"): 1}


@pytest.mark.parametrize("name,kernels", CASES)
def test_every_request_equals_its_solo_run(real_checkpoint, name: str, kernels: str) -> None:
    llm = LLM(str(real_checkpoint(name)), skip_tokenizer_init=True, max_num_seqs=4, max_model_len=256,
              kernels=kernels)
    engine = llm.engine
    rng = random.Random(f"batch-invariance-{name}")
    requests = []
    for i in range(8):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 40))]
        requests.append((prompt, SEEDED if i % 4 == 3 else GREEDY))
    try:
        solo = {}
        for i, (prompt, params) in enumerate(requests):
            solo[f"r{i}"] = run_schedule(engine, [(0, prompt, params)])["r0"]
        # random arrival steps: prefills land beside other sequences' decode tokens
        for round_ in range(ROUNDS_OF.get((name, kernels), ROUNDS)):
            order = list(range(len(requests)))
            rng.shuffle(order)
            arrivals = [(rng.randint(0, 10), *requests[i]) for i in order]
            got = run_schedule(engine, arrivals)
            for j, i in enumerate(order):
                assert got[f"r{j}"] == solo[f"r{i}"], f"{name} round {round_}: request {i} differs from its solo run"
    finally:
        engine.close()
