"""`moeserve simulate` end to end on a small trace."""

from __future__ import annotations

import json
import random

import pytest

from moeserve.cli import main
from moeserve.experts.traces.moetrace import TraceHeader, TraceWriter


def small_trace(path):
    rng = random.Random(0)
    header = TraceHeader(model="toy", num_layers=3, num_experts=8, top_k=2, moe_layers=(0, 1, 2))
    with TraceWriter(path, header) as w:
        for _ in range(40):
            for layer in range(3):
                ids = [rng.sample(range(8), 2) for _ in range(2)]  # 2 tokens, top-2
                w.record(layer, ids, predicted_next=[rng.randrange(8)] if layer < 2 else None)
            w.end_step()


def test_cli_writes_plot_and_json(tmp_path, capsys):
    trace = tmp_path / "toy.moetrace"
    small_trace(trace)
    argv = [
        "simulate",
        str(trace),
        "--policy",
        "lru,lfu,lfru,static,belady",
        "--capacity",
        "4,8,16",
        "--prefetch",
        "none,oracle,predicted,affinity,online",
        "--plot",
        str(tmp_path / "p.png"),
        "--json",
        str(tmp_path / "r.json"),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "vs MIN" in out and "vs MIN+pf" in out and "prefetch=online" in out
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["fit_steps"] == 20 and data["eval_steps"] == 20
    assert len(data["results"]) == 5 * 3 * 5
    for r in data["results"]:
        assert r["hits"] + r["misses"] == data["results"][0]["hits"] + data["results"][0]["misses"]


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["simulate", str(tmp_path / "missing")]) == 1
    assert "no such trace file" in capsys.readouterr().err
    (tmp_path / "junk").write_bytes(b"hello world, not a trace")
    assert main(["simulate", str(tmp_path / "junk")]) == 1
    assert "bad magic" in capsys.readouterr().err
    trace = tmp_path / "toy.moetrace"
    small_trace(trace)
    assert main(["simulate", str(trace), "--policy", "lruu"]) == 1
    assert "--policy 'lruu'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["simulate"])


def test_cli_compares_capacity_modes_and_prefetch_auto(tmp_path, capsys):
    trace = tmp_path / "toy.moetrace"
    small_trace(trace)
    argv = ["simulate", str(trace), "--policy", "lru,lfru,belady", "--capacity", "6,9", "--prefetch", "none,auto",
            "--cache-mode", "shared,per_layer", "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "p.png")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "=== expert cache mode shared" in out and "=== expert cache mode per_layer" in out
    results = json.loads((tmp_path / "r.json").read_text())["results"]
    assert {(r["cache_mode"], r["prefetch"]) for r in results} == {
        (m, p) for m in ("shared", "per_layer") for p in ("none", "auto")}
    assert all(r["auto"] for r in results if r["prefetch"] == "auto")
    assert main(["simulate", str(trace), "--cache-mode", "per-layer"]) != 0
    assert "--cache-mode 'per-layer': choose from shared, per_layer, mixed" in capsys.readouterr().err
