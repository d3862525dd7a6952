"""scripts/gpu_acceptance.sh's hybrid step without a GPU: given a Python that claims CUDA (a stub recording its
arguments), `--hybrid-only` runs scripts/gpu_hybrid_check.py alone (under a timeout) and the full run ends with it;
and the check's bit comparison itself on the CPU (`--device cpu`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.memory.test_gpu_acceptance_script import ROOT, run_script


@pytest.mark.parametrize("hybrid_only", [True, False])
def test_the_hybrid_step_runs(tmp_path: Path, hybrid_only: bool) -> None:
    log = tmp_path / "calls.txt"
    stub = tmp_path / "python"
    stub.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$*\" >> {log}\nexit 0\n")
    stub.chmod(0o755)
    done = run_script(tmp_path, str(stub), *(["--hybrid-only", "--quick"] if hybrid_only else ["--quick"]))
    assert done.returncode == 0, done.stderr
    calls = log.read_text().splitlines()
    assert calls[-1] == "scripts/gpu_hybrid_check.py --shape small"
    assert any(" bench " in f" {c} " for c in calls) != hybrid_only
    assert "hybrid" in done.stdout


def test_the_hybrid_checks_bit_comparison_on_the_cpu() -> None:
    done = subprocess.run([sys.executable, "scripts/gpu_hybrid_check.py", "--device", "cpu", "--shape", "tiny"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("(canonical kernel) equal") == 4 and done.stdout.endswith("hybrid check: PASS\n")
