"""The bench's admission-control variant (`--peers moeserve-admission`): moeserve with expert_admission=policy,
alternated with the default in one run, with its bypassed misses counted beside hits and bytes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moeserve.bench import report, runner
from moeserve.bench.shapes import get_shape
from moeserve.experts.traces.jsonl import write_trace_file
from moeserve.experts.traces.moetrace import LayerRecord, TraceHeader


def test_the_admission_variant_is_the_default_with_admission_by_policy():
    from moeserve.config import EngineSettings, build_settings

    assert runner.SELF_PEERS["moeserve-admission"] == {"expert_admission": "policy"}
    assert "moeserve-admission" in runner.PEERS
    settings = build_settings(EngineSettings, {"model": "m", **runner.SELF_PEERS["moeserve-admission"]})
    assert settings.expert_admission == "policy"
    assert build_settings(EngineSettings, {"model": "m"}).expert_admission != "policy"  # so the pair differs


def _run(engine: str, bypassed: int, tokens_per_s: float) -> runner.CaseResult:
    store = {"hits": 30.0, "misses": 10.0, "bytes_read": 1e6, "bytes_from_disk": 1e6, "bytes_from_host": 0.0,
             "prefetched": 0.0, "prefetch_used": 0.0, "bypassed": float(bypassed)}
    run = {"seconds": 4 / tokens_per_s, "tokens": 4, "steps": 4, "peak_rss_bytes": 1, "store": store,
           "memory_bytes_per_s": 1e9, "load_average": 3.5}
    return runner.CaseResult(engine, "decode-b1", [run])


def test_the_report_gives_bypassed_per_token_the_load_and_the_paired_ratio(tmp_path):
    cfg = runner.BenchConfig(get_shape("tiny"), tmp_path, cases=("decode-b1",), peers=("moeserve-admission",))
    results = [_run("moeserve", 0, 2.0), _run("moeserve-admission", 8, 2.5)]
    summary = report.summarize(cfg, results, [], {"memory_bytes_per_s": 1e9, "disk_bytes_per_s": 1e9},
                               runner.machine_info(), {})
    rows = {r["engine"]: r for r in summary["rows"]}
    assert rows["moeserve"]["bypassed_per_token"] == 0
    assert rows["moeserve-admission"]["bypassed_per_token"] == 2.0
    assert rows["moeserve-admission"]["moeserve_speedup"] == pytest.approx(0.8)  # default / admission, paired
    assert rows["moeserve-admission"]["runs_load_average"] == [3.5]


def _hot_and_one_off_trace(path, tokens: int = 60) -> None:
    """Per layer, expert 0 on every token beside an expert that changes every token: an LFRU cache refuses the
    one-offs with admission control (tests/bench/test_simulate_bypass.py has the simulator's side)."""
    header = TraceHeader(model="t", num_layers=2, num_experts=8, top_k=2, moe_layers=(0, 1))
    steps = [[LayerRecord(layer, np.array([[0, 1 + (t + layer) % 7]], dtype=np.uint16)) for layer in range(2)]
             for t in range(tokens)]
    write_trace_file(path, header, steps, "jsonl")


@pytest.mark.slow
def test_bench_runs_the_admission_variant_beside_the_default(tmp_path, capsys):
    """`moeserve bench --route-trace T --expert-cache-fraction 0.25 --peers moeserve-admission` on the tiny shape:
    both run alternated; the variant bypasses misses, hits at least as often and reads no more from disk."""
    from moeserve.cli import main

    trace = tmp_path / "t.jsonl"
    _hot_and_one_off_trace(trace)
    out = tmp_path / "bench.json"
    rc = main(["bench", "--shape", "tiny", "--cache-dir", str(tmp_path / "cache"), "--tokens", "12", "--repeats",
               "2", "--prompt-len", "4", "--cases", "decode-b1", "--peers", "moeserve-admission",
               "--expert-cache-fraction", "0.25", "--route-trace", str(trace), "--json", str(out)])
    assert rc == 0
    rows = {r["engine"]: r for r in json.loads(out.read_text())["rows"]}
    default, admission = rows["moeserve"], rows["moeserve-admission"]
    assert default["bypassed_per_token"] == 0 and admission["bypassed_per_token"] > 0
    assert admission["expert_hit_rate"] > default["expert_hit_rate"]
    assert admission["bytes_per_token_disk"] < default["bytes_per_token_disk"]
    assert len(admission["runs_tokens_per_s"]) == len(default["runs_tokens_per_s"]) == 2
    assert admission["moeserve_speedup"] is not None  # paired run by run with the default
    assert "moeserve-admission" in capsys.readouterr().out
