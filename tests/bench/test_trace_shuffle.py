"""scripts/trace_shuffle.py: the permutation test of docs/flame-bound.md keeps every step whole and each part's
multiset of steps, and only moves steps within their part."""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

import pytest

from moeserve.bench.traces import load_trace

ROOT = Path(__file__).resolve().parents[2]
from tests.experts.policy_traces import FLAME  # noqa: E402


def _script():
    spec = importlib.util.spec_from_file_location("trace_shuffle", ROOT / "scripts" / "trace_shuffle.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_parts_permuted_separately_steps_whole() -> None:
    steps = [[("L0", i), ("L1", i * 7)] for i in range(101)]
    out = _script().shuffled(list(steps), 0.5, seed=3)
    split = int(101 * 0.5)
    assert Counter(map(repr, out[:split])) == Counter(map(repr, steps[:split]))
    assert Counter(map(repr, out[split:])) == Counter(map(repr, steps[split:]))
    assert out != steps  # the order did change
    assert all(a[1][1] == 7 * a[0][1] for a in out)  # each step's layers travel together
    assert _script().shuffled(list(steps), 0.5, seed=3) == out  # the seed fixes it


def test_written_copy_reads_back(tmp_path: Path) -> None:
    if not FLAME.is_dir():
        pytest.skip("the shared FLAME trace is not on this machine")
    import subprocess
    import sys
    subprocess.run([sys.executable, str(ROOT / "scripts" / "trace_shuffle.py"), str(FLAME), "--out", str(tmp_path),
                    "--seeds", "5"], check=True, capture_output=True)
    original = [repr(s) for s in load_trace(tmp_path / "original.jsonl").steps]
    copy = [repr(s) for s in load_trace(tmp_path / "seed5.jsonl").steps]
    half = len(original) // 2
    assert len(copy) == len(original) == 2048
    assert Counter(copy[half:]) == Counter(original[half:]) and copy != original
