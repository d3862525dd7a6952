"""Admission control in the simulator: `+bypass` policy names in a grid and on the command line."""

from __future__ import annotations

import json

import pytest

from moeserve.bench.simulate import LayerCall, run_grid, split_bypass
from moeserve.cli import main
from moeserve.errors import ConfigError
from moeserve.experts.traces.moetrace import TraceHeader, TraceWriter


def hot_pair_steps(n: int = 40) -> list[list[LayerCall]]:
    """Experts 0 and 1 every step, plus a one-off expert: a cache of 2 keeps the pair only with admission control."""
    return [[LayerCall(0, (0, 1, 100 + i))] for i in range(n)]


def test_split_bypass():
    assert split_bypass("lfru+bypass") == ("lfru", True)
    assert split_bypass("lru") == ("lru", False)


def test_grid_names_bypass_rows_and_bypass_wins_on_one_offs():
    grid = run_grid(hot_pair_steps(), ["lfru", "lfru+bypass", "reuse+bypass"], [2])
    plain, bypass, reuse = (grid.get(p, 2, "none") for p in ("lfru", "lfru+bypass", "reuse+bypass"))
    assert plain and bypass and reuse
    assert plain.accesses == bypass.accesses == reuse.accesses == 120
    assert bypass.hits > plain.hits and reuse.hits > plain.hits
    assert bypass.reads == bypass.misses  # no prefetch: every read is a miss, bypassed or cached


def test_cli_takes_bypass_names(tmp_path, capsys):
    trace = tmp_path / "hot.moetrace"
    header = TraceHeader(model="toy", num_layers=1, num_experts=200, top_k=3, moe_layers=(0,))
    with TraceWriter(trace, header) as w:
        for step in hot_pair_steps():
            w.record(0, [list(step[0].expert_ids)])
            w.end_step()
    out_json = tmp_path / "r.json"
    assert main(["simulate", str(trace), "--policy", "lfru,lfru+bypass,belady", "--capacity", "2",
                 "--json", str(out_json)]) == 0
    assert "lfru+bypass" in capsys.readouterr().out
    rows = {r["policy"]: r for r in json.loads(out_json.read_text())["results"]}
    assert rows["lfru+bypass"]["hits"] > rows["lfru"]["hits"]
    assert main(["simulate", str(trace), "--policy", "lfru+bypas", "--capacity", "2"]) != 0
    assert "did you mean 'lfru+bypass'?" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="belady"):
        run_grid(hot_pair_steps(), ["belady+bypass"], [2])  # the offline bound takes no admission control
