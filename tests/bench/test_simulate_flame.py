"""FLAME converter + simulator against the figures published with the FLAME sample traces."""

from __future__ import annotations

from pathlib import Path

import pytest

from moeserve.bench.flame import convert_flame, load_flame
from moeserve.bench.simulate import calls_from_steps, layer_only, per_expert_calls, simulate
from moeserve.experts.traces.moetrace import read_trace

# shared/ sits beside the checkout (in CI too); /work/shared is where the development machines mount it.
_CANDIDATES = [Path(__file__).resolve().parents[3] / "shared", Path("/work/shared")]
FLAME = next((p for p in _CANDIDATES if p.is_dir()), _CANDIDATES[0]) / "traces" / "flame-moe-290m"
needs_flame = pytest.mark.skipif(not FLAME.is_dir(), reason="FLAME sample traces not present beside the checkout")


@needs_flame
def test_flame_per_layer_sanity_figures():
    # The README: "Sanity check (per-layer cache of 16 of 64 experts): LRU 0.225, Belady 0.560". That is a
    # private 16-expert cache per layer, each expert requested on its own (per-expert calls).
    header, steps = load_flame(FLAME)
    assert header.moe_layers == tuple(range(2, 10)) and header.num_experts == 64 and header.top_k == 6
    calls = per_expert_calls(calls_from_steps(steps))
    for policy, expected in (("lru", 0.225), ("belady", 0.560)):
        hits = accesses = 0
        for layer in header.moe_layers:
            r = simulate(layer_only(calls, layer), policy, 16)
            hits += r.hits
            accesses += r.accesses
        assert accesses == 2048 * 8 * 6
        assert hits / accesses == pytest.approx(expected, abs=0.003), policy


@needs_flame
def test_flame_convert_round_trip(tmp_path):
    header, steps = load_flame(FLAME)
    convert_flame(FLAME, tmp_path / "flame.moetrace")
    trace = read_trace(tmp_path / "flame.moetrace")
    assert trace.header == header
    back = trace.steps()
    assert len(back) == 2048
    for t in (0, 1, 2047):
        assert [r.topk_ids.tolist() for r in back[t]] == [r.topk_ids.tolist() for r in steps[t]]
    # token 0 of layer 2 (first data row of the CSV): top-6 by score are experts 34, 28, 21, 47, 3, 12.
    assert back[0][0].topk_ids.tolist() == [[34, 28, 21, 47, 3, 12]]
