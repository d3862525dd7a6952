"""`moeserve trace convert` and `moeserve simulate` on the JSON-lines format: a slice of the real FLAME trace
converted to JSON lines (and on to the other formats) simulates to exactly the figures of the FLAME folder itself."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from moeserve.bench.flame import find_layer_dirs, load_flame
from moeserve.bench.traces import convert, load_trace
from moeserve.cli import main
from moeserve.experts.traces.moetrace import TraceError, TraceHeader, TraceWriter
from tests.bench.test_simulate_flame import FLAME, needs_flame

TOKENS = 160  # the slice: the first tokens of every layer


@pytest.fixture(scope="module")
def flame_slice(tmp_path_factory) -> Path:
    """The first TOKENS rows of every layer's CSV of the real FLAME trace, as a FLAME folder of its own."""
    root = tmp_path_factory.mktemp("flame_slice")
    for layer, source in find_layer_dirs(FLAME).items():
        (root / f"Layer_{layer}").mkdir()
        with open(source) as f:
            head = [next(f) for _ in range(TOKENS + 1)]
        (root / f"Layer_{layer}" / source.name).write_text("".join(head))
    return root


def top_k_by_score(csv_path: Path, token: int, k: int) -> list[int]:
    """Read one CSV row on its own (not through moeserve): expert ids by descending score, the first k."""
    with open(csv_path) as f:
        row = list(csv.reader(f))[1 + token]
    scores = [float(x) for x in row[2:]]
    return sorted(range(len(scores)), key=lambda e: -scores[e])[:k]


def simulate_json(trace: Path, out: Path, *extra: str) -> list[dict]:
    argv = ["simulate", str(trace), "--policy", "lru,lfu,lfru,static,belady", "--capacity", "8,24,64,160",
            "--prefetch", "none,oracle,affinity,online", "--json", str(out), *extra]
    assert main(argv) == 0
    return json.loads(out.read_text())["results"]


@needs_flame
def test_flame_to_jsonl_simulates_to_the_same_figures(flame_slice, tmp_path, capsys):
    jsonl = tmp_path / "flame.jsonl"
    assert main(["trace", "convert", str(flame_slice), str(jsonl)]) == 0
    assert f"{TOKENS} steps" in capsys.readouterr().out
    lines = jsonl.read_text().splitlines()
    assert len(lines) == 1 + TOKENS * 8  # the header, then one line per token per layer
    header = json.loads(lines[0])
    assert (header["num_experts"], header["top_k"], header["moe_layers"]) == (64, 6, list(range(2, 10)))
    first = json.loads(lines[1])
    csv2 = find_layer_dirs(flame_slice)[2]
    assert first == {"step": 0, "layer": 2, "experts": [top_k_by_score(csv2, 0, 6)]}
    last = json.loads(lines[-1])
    assert (last["step"], last["layer"]) == (TOKENS - 1, 9)
    assert last["experts"] == [top_k_by_score(find_layer_dirs(flame_slice)[9], TOKENS - 1, 6)]

    direct = simulate_json(flame_slice, tmp_path / "direct.json")
    via_jsonl = simulate_json(jsonl, tmp_path / "jsonl.json")
    assert len(direct) == 5 * 4 * 4
    assert via_jsonl == direct
    assert any(0 < r["hit_rate"] < 1 for r in direct)  # the figures compared are not all trivial
    assert len({r["hit_rate"] for r in direct}) > 10


@needs_flame
def test_jsonl_converts_on_to_binary_and_back_to_flame(flame_slice, tmp_path):
    jsonl, binary, folder = tmp_path / "t.jsonl", tmp_path / "t.moetrace", tmp_path / "flame_again"
    convert(flame_slice, jsonl)
    assert main(["trace", "convert", str(jsonl), str(binary), "--to", "moetrace"]) == 0
    assert main(["trace", "convert", str(binary), str(folder), "--to", "flame"]) == 0
    header, steps = load_flame(flame_slice)
    for path in (jsonl, binary, folder):
        trace = load_trace(path)
        assert trace.header.moe_layers == header.moe_layers and trace.header.num_experts == header.num_experts
        assert [[r.topk_ids.tolist() for r in s] for s in trace.steps] == [[r.topk_ids.tolist() for r in s]
                                                                        for s in steps], path
    # The scores are rank scores, not the router's: only the order survives.
    assert top_k_by_score(find_layer_dirs(folder)[5], 7, 6) == top_k_by_score(find_layer_dirs(flame_slice)[5], 7, 6)
    assert main(["simulate", str(folder), "--trace-format", "jsonl"]) == 1  # a folder is not a JSON-lines file


def test_a_bare_jsonl_trace_simulates_and_says_what_it_inferred(tmp_path, capsys):
    path = tmp_path / "bare.jsonl"
    path.write_text("".join(
        json.dumps({"step": s, "layer": layer, "experts": [[(s + layer) % 6, (s * 3 + layer + 1) % 6]]}) + "\n"
        for s in range(12) for layer in (0, 1)
    ))
    out = tmp_path / "r.json"
    assert main(["simulate", str(path), "--policy", "lru,belady", "--capacity", "2,4", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "header: inferred num_experts=6" in printed and "header: inferred top_k=2" in printed
    results = json.loads(out.read_text())["results"]
    assert all(r["hits"] + r["misses"] == 12 * 2 * 2 for r in results)  # two distinct experts per call


def test_errors_are_one_line_and_unknown_flags_get_a_suggestion(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1, "layer": 0, "experts": [[1]]}\n{"step": 0, "layer": 0, "experts": [[2]]}\n')
    assert main(["simulate", str(bad)]) == 1
    assert f"{bad}:2: step 0 after step 1" in capsys.readouterr().err
    assert main(["trace", "convert", str(bad), str(tmp_path / "out.jsonl")]) == 1
    assert capsys.readouterr().err.count("\n") == 1
    assert main(["trace", "convert", str(bad), str(bad)]) == 1
    assert "would overwrite the input" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["simulate", str(bad), "--trace-fromat", "jsonl"])
    assert "did you mean --trace-format?" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["trace", "convert", str(bad), str(tmp_path / "o"), "--too", "flame"])
    assert "did you mean --to?" in capsys.readouterr().err


def test_flame_output_refuses_batched_steps(tmp_path):
    header = TraceHeader(model="toy", num_layers=2, num_experts=8, top_k=2, moe_layers=(0, 1))
    with TraceWriter(tmp_path / "t.moetrace", header) as w:
        w.record(0, [[1, 2], [3, 4]])  # two tokens in one step
        w.record(1, [[1, 2], [3, 4]])
        w.end_step()
    with pytest.raises(TraceError, match="one token per step"):
        convert(tmp_path / "t.moetrace", tmp_path / "out", "flame")
