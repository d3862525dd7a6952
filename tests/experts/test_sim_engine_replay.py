"""The cache simulator replays a real offloaded run exactly: the routing trace the engine recorded, replayed through
`moeserve.bench.simulate` with the engine's capacity and policy, gives the engine's hits and misses per layer."""

from __future__ import annotations

from pathlib import Path

import pytest

import moeserve
from moeserve import LLM, SamplingParams
from moeserve.bench.simulate import calls_from_steps, simulate
from moeserve.experts.traces.moetrace import read_trace

DEMO = Path(moeserve.__file__).resolve().parent / "demo_model"
pytestmark = pytest.mark.skipif(not (DEMO / "model.safetensors").is_file(), reason="demo model not built")
PROMPTS = ["Once upon a time", "It is a truth universally acknowledged, that", "The"]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
UNIT_NBYTES = {"float32": 1179648, "bfloat16": 589824}  # one demo expert unit (checked below)


def run(tmp_path: Path, dtype: str, capacity: int, policy: str, trace: bool = True, **settings):  # noqa: ANN201
    """Generate PROMPTS offloaded: the store's (hits, misses) per layer, the tokens, the trace file (None without
    a trace) and how many layer calls were reported as run on cached units without asking the store."""
    path = tmp_path / f"{dtype}-{capacity}-{policy}.trace" if trace else None
    llm = LLM(str(DEMO), dtype=dtype, threads=1, expert_cache_gb=capacity * UNIT_NBYTES[dtype] / 2**30,
              cache_policy=policy, record_trace=None if path is None else str(path), **settings)
    store = llm.engine.model.store
    reported = 0
    report = store.report_cached_calls

    def counting(log=(), hits_per_layer=()):  # noqa: ANN001, ANN202
        nonlocal reported
        i = 0
        while i < len(log):
            reported, i = reported + 1, i + 2 + log[i + 1]
        report(log, hits_per_layer)

    store.report_cached_calls = counting  # type: ignore[method-assign]
    try:
        assert store.unit_nbytes == UNIT_NBYTES[dtype] and store.capacity == capacity
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
        counts = {layer: (s.hits, s.misses) for layer, s in sorted(store.stats.layers.items())}
    finally:
        llm.engine.close()
    return counts, tokens, path, reported


@pytest.mark.parametrize("policy", ["lru", "lfu", "lfru"])
@pytest.mark.parametrize("capacity", [12, 16, 24])
def test_simulator_gives_the_engines_hits_and_misses_per_layer(tmp_path, policy, capacity):
    engine, _, trace, _ = run(tmp_path, "float32", capacity, policy)
    assert trace is not None
    sim = simulate(calls_from_steps(read_trace(trace)), policy, capacity)
    assert sim.per_layer == engine
    assert sim.hits > 0 and sim.misses > 0  # the cache both hit and missed: the comparison means something


def test_the_fused_decode_step_reports_its_cached_calls_as_the_simulator_counts_them(tmp_path):
    """The C++ decode stack runs layers whose experts are all cached without asking the store, then reports them
    (report_cached_calls). A run without a trace (the stack, where the CPU supports it) hears the same routing as
    a traced run (per-op: the trace hook sees every layer) and must count exactly what the simulator counts."""
    traced, tokens, trace, _ = run(tmp_path, "bfloat16", 12, "lfru")
    fused, fused_tokens, _, reported = run(tmp_path, "bfloat16", 12, "lfru", trace=False)
    assert trace is not None and fused_tokens == tokens
    if not reported:
        pytest.skip("the fused decode step does not run here (it needs the C++ kernels with AVX512-BF16)")
    sim = simulate(calls_from_steps(read_trace(trace)), "lfru", 12)
    assert sim.per_layer == traced == fused


def test_with_prefetch_every_needed_expert_is_still_counted_once(tmp_path):
    """Prefetch makes the engine's hits depend on its threads' timing; the accesses per layer do not."""
    engine, _, trace, _ = run(tmp_path, "float32", 12, "lfru", prefetch=True)
    assert trace is not None
    sim = simulate(calls_from_steps(read_trace(trace)), "lfru", 12)
    assert {layer: h + m for layer, (h, m) in sim.per_layer.items()} == \
        {layer: h + m for layer, (h, m) in engine.items()}


@pytest.mark.parametrize("mode", ["per_layer", "mixed"])
@pytest.mark.parametrize("policy", ["lru", "lfru"])
def test_capacity_modes_replay_exactly(tmp_path, mode, policy):
    """expert_cache_mode in the engine == --cache-mode in the simulator, per layer (12 slots: 3 per layer)."""
    engine, _, trace, _ = run(tmp_path, "float32", 12, policy, expert_cache_mode=mode)
    assert trace is not None
    sim = simulate(calls_from_steps(read_trace(trace)), policy, 12, cache_mode=mode)
    assert sim.per_layer == engine
    assert sim.hits > 0 and sim.misses > 0
