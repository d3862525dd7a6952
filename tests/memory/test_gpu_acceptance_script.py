"""scripts/gpu_acceptance.sh without a GPU: it refuses in one line (exit 2, nothing run) where torch has no CUDA,
and, given a Python that claims CUDA (a stub recording its arguments), it runs each step, the bench with
`--device cuda` on the small and the large shape (only the small with --quick)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_acceptance.sh"


def run_script(tmp_path: Path, python: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": python, "OUT": str(tmp_path / "out")}
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=120)


def test_without_cuda_it_says_so_in_one_line_and_runs_nothing(tmp_path: Path) -> None:
    done = run_script(tmp_path, sys.executable)  # this machine's torch: no CUDA device
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("gpu_acceptance: no CUDA device here")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("quick", [False, True])
def test_the_bench_steps_run_moeserve_on_cuda(tmp_path: Path, quick: bool) -> None:
    log = tmp_path / "calls.txt"
    stub = tmp_path / "python"
    stub.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$*\" >> {log}\nexit 0\n")  # every command "passes"
    stub.chmod(0o755)
    done = run_script(tmp_path, str(stub), *(["--quick"] if quick else []))
    assert done.returncode == 0, done.stderr
    benches = [line for line in log.read_text().splitlines() if " bench " in f" {line} "]
    shapes = ["small"] if quick else ["small", "large"]
    assert len(benches) == len(shapes)
    for line, shape in zip(benches, shapes):
        assert f"bench --shape {shape} --device cuda --peers none --json" in line
