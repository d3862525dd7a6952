"""`moeserve bench` end to end on the tiny shape: every case runs, the figures are consistent, JSON is written."""

from __future__ import annotations

import json
import os

import pytest

from moeserve.cli import main
from moeserve.memory import probes


def _bench(tmp_path, *extra: str) -> dict:
    out = tmp_path / "bench.json"
    rc = main(["bench", "--shape", "tiny", "--cache-dir", str(tmp_path / "cache"), "--tokens", "2",
               "--repeats", "1", "--prompt-len", "4", "--prefill-len", "8", "--json", str(out), *extra])
    assert rc == 0
    return json.loads(out.read_text())


def test_bench_smoke_moeserve_alone(tmp_path, capsys):
    summary = _bench(tmp_path, "--peers", "none")
    rows = {(r["case"], r["engine"]): r for r in summary["rows"]}
    assert set(rows) == {("decode-b1", "moeserve"), ("decode-b8", "moeserve"), ("prefill", "moeserve")}
    for row in rows.values():
        assert row["tokens_per_s"] > 0 and row["ceiling_tokens_per_s"] > 0
        assert row["fraction_of_ceiling"] == pytest.approx(row["tokens_per_s"] / row["ceiling_tokens_per_s"])
        assert row["expert_hit_rate"] == 1.0  # tiny shape: every expert resident
        assert row["bytes_per_token_disk"] == 0
        assert row["peak_rss_bytes"] > 10 * 2**20
    # batch 8 reads the dense weights once for 8 tokens: fewer bytes per token than batch 1
    assert rows[("decode-b8", "moeserve")]["bytes_per_token_memory"] < rows[("decode-b1", "moeserve")][
        "bytes_per_token_memory"]
    assert summary["bandwidths"]["memory_bytes_per_s"] > 0 and summary["bandwidths"]["disk_bytes_per_s"] > 0
    printed = capsys.readouterr().out
    assert "decode-b1" in printed and "ceiling" in printed


@pytest.mark.slow
def test_bench_smoke_with_transformers_peer_and_offload(tmp_path):
    pytest.importorskip("transformers")
    summary = _bench(tmp_path, "--peers", "transformers", "--cases", "decode-b1", "--expert-cache-gb", "0.0001")
    rows = {r["engine"]: r for r in summary["rows"]}
    assert set(rows) == {"moeserve", "transformers"}
    ours = rows["moeserve"]
    assert ours["expert_hit_rate"] < 1.0 and ours["bytes_per_token_disk"] > 0  # a 2-expert cache misses
    assert rows["transformers"]["moeserve_speedup"] > 0


@pytest.mark.slow
def test_bench_accelerate_offload_peer_runs_and_cleans_up(tmp_path):
    pytest.importorskip("accelerate")
    summary = _bench(tmp_path, "--peers", "accelerate", "--cases", "decode-b1")
    assert {r["engine"] for r in summary["rows"]} == {"moeserve", "accelerate"}
    assert not list((tmp_path / "cache").glob("offload-*"))  # the offloaded copy is removed after the run


def test_bench_rejects_unknown_peer(tmp_path, capsys):
    assert main(["bench", "--shape", "tiny", "--peers", "vllm", "--cache-dir", str(tmp_path)]) == 1
    assert "unknown peer 'vllm'" in capsys.readouterr().err


def test_probes_measure_something(tmp_path):
    assert probes.memory_bandwidth(nbytes=8 * 2**20, repeats=2) > 1e7
    f = tmp_path / "data.bin"
    f.write_bytes(os.urandom(3 * 2**20))
    assert probes.disk_read_bandwidth([f], repeats=1) > 1e6
    with pytest.raises(ValueError):
        probes.disk_read_bandwidth([tmp_path / "missing.bin"])


def test_bench_gguf_refusals_are_one_line(tmp_path, capsys):
    """--gguf: a missing file, a llama.cpp peer that would make its own GGUF, moeserve's on-load quantization and a
    file of another shape are each refused in one line, before anything is built."""
    junk = tmp_path / "x.gguf"
    junk.write_bytes(b"GGUF")
    base = ["bench", "--shape", "tiny", "--cache-dir", str(tmp_path / "cache")]
    for extra, said in ((["--gguf", str(tmp_path / "none.gguf")], "no such file"),
                        (["--gguf", str(junk), "--peers", "llama.cpp-q8"], "makes its own GGUF"),
                        (["--gguf", str(junk), "--quantization", "int8"], "does not apply"),
                        (["--gguf", str(junk)], "x.gguf")):
        assert main([*base, *extra]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert said in err[-1], err
    assert not (tmp_path / "cache").exists()
