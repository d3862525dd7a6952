"""Trace-driven routing (`moeserve bench --route-trace`): the mapping of a trace onto a model, the engine routing
exactly as the trace says (its recorded trace equals the input, its store counts what the simulator counts on the
input), and serving having no way to it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import moeserve
from moeserve.bench import route_trace
from moeserve.bench.route_trace import TraceRouter, map_trace, trace_tokens
from moeserve.bench.simulate import calls_from_steps, simulate
from moeserve.experts.traces.jsonl import read_jsonl_trace, write_trace_file
from moeserve.experts.traces.moetrace import LayerRecord, TraceError, TraceHeader

DEMO = Path(moeserve.__file__).resolve().parent / "demo_model"
DEMO_UNIT_BYTES = 589824  # one bf16 expert unit of the demo model
needs_demo = pytest.mark.skipif(not (DEMO / "model.safetensors").is_file(), reason="demo model not built")


# ----------------------------------------------------------------------------------------------- mapping (numpy)
def test_same_sizes_map_unchanged_with_no_notes():
    tokens = np.random.default_rng(0).integers(0, 8, size=(5, 3, 1)).repeat(2, axis=2)  # [T, L, k]
    tokens[..., 1] = (tokens[..., 0] + 3) % 8
    mapped = map_trace(tokens, 3, 8, 2)
    assert np.array_equal(mapped.ids, tokens) and mapped.notes == []


def test_layers_cycle_modulo_when_counts_differ():
    tokens = np.array([[[0, 1], [2, 3]]])  # 1 token, 2 trace layers, top-2
    mapped = map_trace(tokens, 5, 8, 2)
    assert mapped.ids[0].tolist() == [[0, 1], [2, 3], [0, 1], [2, 3], [0, 1]]
    assert any("i mod 2" in n for n in mapped.notes)


def test_experts_modulo_drop_collisions_and_keep_the_first_k():
    # 64-expert ids onto 32 experts, top-6 onto top-4: 35 -> 3 collides with 3 and is dropped, 40 -> 8
    tokens = np.array([[[3, 35, 10, 40, 12, 7]]])
    mapped = map_trace(tokens, 1, 32, 4)
    assert mapped.ids[0, 0].tolist() == [3, 10, 8, 12]
    assert any("id mod 32" in n and "1 of" in n for n in mapped.notes)
    assert any("keeps its first 4" in n for n in mapped.notes)


def test_too_few_distinct_ids_are_filled_with_the_next_free_and_said():
    mapped = map_trace(np.array([[[5, 13]]]), 1, 8, 3)  # 13 -> 5: one distinct id for top-3
    assert mapped.ids[0, 0].tolist() == [5, 6, 7]
    assert any("2 ids filled" in n for n in mapped.notes)


def _header(layers=(1, 2), experts=8, k=2) -> TraceHeader:
    return TraceHeader(model="t", num_layers=max(layers) + 1, num_experts=experts, top_k=k, moe_layers=layers)


def test_trace_tokens_flattens_steps_and_refuses_a_step_missing_a_layer():
    rec = lambda layer, rows: LayerRecord(layer, np.array(rows, dtype=np.uint16))  # noqa: E731
    steps = [[rec(1, [[0, 1], [2, 3]]), rec(2, [[4, 5], [6, 7]])], [rec(1, [[1, 2]]), rec(2, [[3, 4]])]]
    assert trace_tokens(_header(), steps).tolist() == [[[0, 1], [4, 5]], [[2, 3], [6, 7]], [[1, 2], [3, 4]]]
    with pytest.raises(TraceError, match="step 0: layers \\[1\\]"):
        trace_tokens(_header(), [[rec(1, [[0, 1]])]])
    with pytest.raises(TraceError, match="no steps"):
        trace_tokens(_header(), [])


def test_router_takes_the_next_tokens_per_pass_cycling_and_reuses_them_in_later_layers():
    ids = np.arange(5 * 2 * 1).reshape(5, 2, 1)  # token t, layer i -> 2t + i
    router = TraceRouter(map_trace(ids, 2, 64, 1))
    assert router(0, 3).flatten().tolist() == [0, 2, 4]
    assert router(1, 3).flatten().tolist() == [1, 3, 5]
    assert router(0, 3).flatten().tolist() == [6, 8, 0]  # tokens 3, 4, then back to 0
    with pytest.raises(TraceError, match="routes 2 tokens"):
        router(1, 2)


# ----------------------------------------------------------------------------------------------- the engine
def _random_trace(path: Path, step_tokens: list[int], seed: int) -> None:
    """A JSON-lines trace for the demo model (4 MoE layers, 8 experts, top-2), steps of the given token counts."""
    rng = np.random.default_rng(seed)
    header = TraceHeader(model="demo", num_layers=4, num_experts=8, top_k=2, moe_layers=(0, 1, 2, 3))
    steps = [[LayerRecord(layer, np.stack([rng.choice(8, 2, replace=False) for _ in range(n)]).astype(np.uint16))
              for layer in range(4)] for n in step_tokens]
    write_trace_file(path, header, steps, "jsonl")


def _run(trace: Path, record: Path | None, capacity: int) -> tuple[list[list[int]], dict[int, tuple[int, int]]]:
    from moeserve import LLM, SamplingParams

    llm = LLM(str(DEMO), skip_tokenizer_init=True, expert_cache_gb=capacity * DEMO_UNIT_BYTES / 2**30,
              record_trace=None if record is None else str(record), record_trace_format="jsonl")
    try:
        route_trace.install(llm.engine.model, trace)
        prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": [10, 11, 12]}]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        store = llm.engine.model.store
        counts = {layer: (s.hits, s.misses) for layer, s in sorted(store.stats.layers.items())}
    finally:
        llm.engine.close()
    return [o.outputs[0].token_ids for o in outs], counts


@needs_demo
def test_the_engine_routes_exactly_as_the_trace_says(tmp_path):
    """Two prompts (5 + 3 tokens: one prefill step of 8), then 5 decode steps of 2: the recorded trace equals the
    input step for step, and without recording (the path the bench runs) the store hears the same calls: its hits
    and misses are the simulator's replay of the input trace (bf16, default settings, offloaded)."""
    trace, recorded = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _random_trace(trace, [8, 2, 2, 2, 2, 2], seed=1)
    tokens, traced_counts = _run(trace, recorded, capacity=12)
    want, got = read_jsonl_trace(trace).steps, read_jsonl_trace(recorded).steps
    assert len(got) == len(want) == 6
    for a, b in zip(want, got):
        assert [(r.layer, r.topk_ids.tolist()) for r in a] == [(r.layer, r.topk_ids.tolist()) for r in b]
    untraced_tokens, counts = _run(trace, None, capacity=12)
    assert untraced_tokens == tokens
    sim = simulate(calls_from_steps(read_jsonl_trace(trace).steps), "lfru", 12)
    assert sim.per_layer == counts == traced_counts
    assert sim.hits > 0 and sim.misses > 0


@needs_demo
def test_force_routing_none_gives_the_routers_back():
    from moeserve import LLM
    from moeserve.models.experts.moe import ForcedRouting

    llm = LLM(str(DEMO), skip_tokenizer_init=True, expert_cache_gb=12 * DEMO_UNIT_BYTES / 2**30)
    try:
        model = llm.engine.model
        own = [block.routing for block in model.moe_blocks]
        model.force_routing(lambda i, n: None)
        model.force_routing(lambda i, n: None)  # twice: still wraps the routers' own routing, not itself
        assert all(isinstance(b.routing, ForcedRouting) and b.routing.inner is r for b, r in zip(model.moe_blocks, own))
        assert model.moe_blocks[0].why_not_stacked() == "routing forced by a trace (benchmark only)"
        model.force_routing(None)
        assert [block.routing for block in model.moe_blocks] == own
    finally:
        llm.engine.close()


# ----------------------------------------------------------------------------------------------- serving refuses
def test_no_setting_reaches_the_hook():
    from moeserve.config import EngineSettings, build_settings
    from moeserve.errors import ConfigError

    for name in ("route_trace", "routing_trace", "force_routing"):
        with pytest.raises(ConfigError):
            build_settings(EngineSettings, {name: "x.jsonl"})


@pytest.mark.parametrize("command", ["serve", "generate", "chat"])
def test_serve_generate_and_chat_refuse_a_route_trace_flag(command, capsys):
    from moeserve.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main([command, "--route-trace", "x.jsonl"])
    assert exit_info.value.code != 0
    assert "route-trace" in capsys.readouterr().err


def test_a_route_trace_environment_variable_is_refused(monkeypatch):
    from moeserve.config import EngineSettings, build_settings
    from moeserve.errors import ConfigError

    monkeypatch.setenv("MOESERVE_ROUTE_TRACE", "x.jsonl")
    with pytest.raises(ConfigError, match="MOESERVE_ROUTE_TRACE"):
        build_settings(EngineSettings, {})


def test_flame_folder_maps_onto_the_small_shape():
    """The shared FLAME sample (8 MoE layers, top-6 of 64) onto the bench's small shape (16 layers, top-4 of 32)."""
    folder = Path("/work/shared/traces/flame-moe-290m")
    if not folder.is_dir():
        pytest.skip("no FLAME sample traces here")
    from moeserve.bench.traces import load_trace

    trace = load_trace(folder)
    mapped = map_trace(trace_tokens(trace.header, trace.steps), 16, 32, 4)
    assert mapped.ids.shape == (2048, 16, 4)
    assert all(len(set(row)) == 4 for row in mapped.ids.reshape(-1, 4).tolist())
    assert json.dumps(mapped.notes)  # three notes: layers, experts, top-k
    assert len(mapped.notes) == 3


@pytest.mark.slow
def test_bench_with_a_route_trace_and_a_cache_fraction(tmp_path, capsys):
    """`moeserve bench --route-trace` on the tiny shape (2 layers, top-2 of 8), a trace of another size (3 layers,
    16 experts, top-3): moeserve and its LRU variant run, the transformers peer is skipped with the reason, the
    cache holds 25% of the experts and misses, and the table says the routing was forced."""
    from moeserve.cli import main

    trace = tmp_path / "t.jsonl"
    rng = np.random.default_rng(0)
    header = TraceHeader(model="t", num_layers=3, num_experts=16, top_k=3, moe_layers=(0, 1, 2))
    steps = [[LayerRecord(layer, rng.choice(16, (1, 3), replace=False).astype(np.uint16)) for layer in range(3)]
             for _ in range(50)]
    write_trace_file(trace, header, steps, "jsonl")
    out = tmp_path / "bench.json"
    rc = main(["bench", "--shape", "tiny", "--cache-dir", str(tmp_path / "cache"), "--tokens", "4", "--repeats", "1",
               "--prompt-len", "4", "--cases", "decode-b1", "--peers", "moeserve-lru,moeserve-prefetch-auto,transformers",
               "--expert-cache-fraction", "0.25", "--route-trace", str(trace), "--json", str(out)])
    assert rc == 0
    summary = json.loads(out.read_text())
    rows = {r["engine"]: r for r in summary["rows"]}
    skipped = {s["engine"]: s["reason"] for s in summary["skipped"]}
    # prefetch=auto runs where this build has it, else it is skipped with the setting's error
    assert {"moeserve", "moeserve-lru"} <= set(rows)
    assert set(rows) | set(skipped) == {"moeserve", "moeserve-lru", "moeserve-prefetch-auto", "transformers"}
    assert "--route-trace" in skipped["transformers"]
    for row in rows.values():
        assert 0 < row["expert_hit_rate"] < 1 and row["bytes_per_token_disk"] > 0
    assert summary["settings"]["route_trace"] == str(trace)
    assert "ROUTING FORCED BY THE TRACE" in capsys.readouterr().out


def test_a_missing_or_malformed_route_trace_is_one_line_before_anything_is_built(tmp_path, capsys):
    from moeserve.cli import main

    cache = tmp_path / "cache"
    assert main(["bench", "--shape", "tiny", "--cache-dir", str(cache), "--route-trace", str(tmp_path / "no")]) == 1
    assert "--route-trace" in (err := capsys.readouterr().err) and "no such file or folder" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 0, "layer": 1, "experts": [[1, 2]]}\n{"step": 0, "layer": 1, "experts": [[1, 2]]}\n')
    assert main(["bench", "--shape", "tiny", "--cache-dir", str(cache), "--route-trace", str(bad)]) == 1
    assert "layer 1 twice in step 0" in capsys.readouterr().err
    assert not cache.exists()  # refused before the synthetic model was built
