"""`moeserve bench sequence-memory --quick` end to end on a tiny model: every figure but the commit comparison (a git
worktree and a second engine process) is measured and printed, and the report is appended to --docs only."""

from __future__ import annotations

from pathlib import Path

import pytest

from moeserve.bench.variants.sequence_memory import SECTION
from moeserve.cli import main

pytestmark = pytest.mark.slow


def test_quick_run_prints_every_figure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    docs = tmp_path / "benchmarks.md"
    assert main(["bench", "sequence-memory", "--quick", "--items", "1,2,3,4", "--cache-dir", str(tmp_path / "cache"),
                 "--docs", str(docs)]) == 0
    out = capsys.readouterr().out
    for figure in ("1. TTFT", "2. prefill, 2nd request", "3. batch-1 decode", "4. KV memory used"):
        assert figure in out
    assert "5. batch-1 decode vs" not in out
    assert "meets the >= 0.90 target" in out  # whole blocks only: a few tokens short per sequence
    assert "(256 tokens hit)" in out  # the whole shared system prompt (16 full blocks) is a hit
    section = docs.read_text()
    assert section.startswith("\n## " + SECTION) and section.count("| 4. KV memory used") == 1


def test_unknown_figures_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "sequence-memory", "--items", "1,7"]) == 1
    assert "--items '1,7': figures are numbered 1-5" in capsys.readouterr().err
