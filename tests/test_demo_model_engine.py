"""The shipped demo model through moeserve: same greedy tokens as transformers, offloaded == resident on a
TRAINED model (non-uniform routing), and its routing trace replayed by the cache simulator."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import moeserve
from moeserve import LLM, SamplingParams

DEMO = Path(moeserve.__file__).resolve().parent / "demo_model"
pytestmark = pytest.mark.skipif(not (DEMO / "model.safetensors").is_file(), reason="demo model not built")
PROMPTS = ["Once upon a time", "It is a truth universally acknowledged, that"]
STEPS = 24


def test_greedy_tokens_equal_transformers() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DEMO)
    ref = AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32).eval()
    llm = LLM(dtype="float32")  # no model: the bundled demo model
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        ids = tok(prompt).input_ids
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            gen = ref.generate(torch.tensor([ids]), max_new_tokens=STEPS, do_sample=False, eos_token_id=None,
                               pad_token_id=0)
        assert out.outputs[0].token_ids == gen[0, len(ids):].tolist()


def test_offloaded_equals_resident_on_the_trained_model(tmp_path: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
    resident = LLM(str(DEMO), dtype="float32", threads=1)
    unit = resident.engine.model.store.unit_nbytes
    ref = resident.generate(PROMPTS, params)
    trace = tmp_path / "demo.trace"
    offloaded = LLM(str(DEMO), dtype="float32", threads=1, expert_cache_gb=3 * unit / 2**30, prefetch=True,
                    record_trace=str(trace))
    got = offloaded.generate(PROMPTS, params)
    assert offloaded.stats.misses > 0  # experts really came from disk
    for a, b in zip(ref, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for lp_a, lp_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert {t: v.logprob for t, v in lp_a.items()} == {t: v.logprob for t, v in lp_b.items()}
    offloaded.engine.close()
    _replay(trace)


def _replay(trace: Path) -> None:
    """The recorded routing replays through the simulator: Belady bounds every online policy."""
    from moeserve.bench.simulate import calls_from_steps, simulate
    from moeserve.experts.traces.moetrace import read_trace

    steps = calls_from_steps(read_trace(trace))
    assert steps, "the trace recorded no steps"
    rates = {p: simulate(steps, p, capacity=8).hit_rate for p in ("lru", "lfu", "lfru", "belady")}
    assert all(rates["belady"] >= rates[p] - 1e-12 for p in ("lru", "lfu", "lfru"))
    assert 0 < rates["belady"] < 1
