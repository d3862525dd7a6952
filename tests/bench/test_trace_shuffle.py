"""`moeserve trace shuffle`: the permutation test of docs/flame-bound.md keeps every step whole and each part's
multiset of steps, and only moves steps within their part."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from moeserve.bench.traces import load_trace, shuffled
from moeserve.cli import main
from tests.experts.policy_traces import FLAME

DEMO_TRACE = Path(__file__).resolve().parents[1] / "experts" / "data" / "demo-batch1.jsonl"


def test_parts_permuted_separately_steps_whole() -> None:
    steps = [[("L0", i), ("L1", i * 7)] for i in range(101)]
    out = shuffled(list(steps), 0.5, seed=3)
    split = int(101 * 0.5)
    assert Counter(map(repr, out[:split])) == Counter(map(repr, steps[:split]))
    assert Counter(map(repr, out[split:])) == Counter(map(repr, steps[split:]))
    assert out != steps  # the order did change
    assert all(a[1][1] == 7 * a[0][1] for a in out)  # each step's layers travel together
    assert shuffled(list(steps), 0.5, seed=3) == out  # the seed fixes it


@pytest.mark.parametrize(("trace", "steps"), [(DEMO_TRACE, 256), (FLAME, 2048)], ids=["demo", "flame"])
def test_written_copy_reads_back(trace: Path, steps: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if not trace.exists():
        pytest.skip("the shared FLAME trace is not on this machine")
    assert main(["trace", "shuffle", str(trace), "--out", str(tmp_path), "--seeds", "5"]) == 0
    original = [repr(s) for s in load_trace(tmp_path / "original.jsonl").steps]
    copy = [repr(s) for s in load_trace(tmp_path / "seed5.jsonl").steps]
    half = len(original) // 2
    assert len(copy) == len(original) == steps
    assert Counter(copy[half:]) == Counter(original[half:]) and copy != original
    assert f"seed5.jsonl: {len(copy)} steps" in capsys.readouterr().out


def test_bad_seeds_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "shuffle", str(DEMO_TRACE), "--out", str(tmp_path), "--seeds", "a"]) == 1
    assert "--seeds 'a': expected comma-separated integers" in capsys.readouterr().err
