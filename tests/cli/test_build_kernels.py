"""`moeserve build-kernels` and the first build explaining itself: the build announced with an estimate before it
starts, one line per compiled source, a one-line error when it cannot build, and the engine's load time without
the build. A stand-in compiler (writes an empty file at -o) makes a "build" instant; the empty library then fails to
load, which is the failure path."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from moeserve import kernels
from moeserve.cli import main
from tests.kernels.ops import suite_isa

FAKE_CXX = """#!/bin/sh
while [ $# -gt 0 ]; do if [ "$1" = "-o" ]; then : > "$2"; fi; shift; done
"""


def build_kernels(tmp_path: Path, cxx: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "CXX": cxx}
    return subprocess.run([sys.executable, "-m", "moeserve", "build-kernels"], capture_output=True, text=True,
                          timeout=300, env=env)


def test_the_build_is_announced_then_each_source_as_it_compiles(tmp_path: Path) -> None:
    fake = tmp_path / "fake-g++"
    fake.write_text(FAKE_CXX)
    fake.chmod(0o755)
    proc = build_kernels(tmp_path, str(fake))
    sources = len(list(kernels.CSRC.glob("*.cpp")))
    lines = proc.stderr.splitlines()
    announce = [i for i, line in enumerate(lines) if "kernels: building C++ kernels (first use" in line]
    assert len(announce) == 1, proc.stderr
    assert re.search(rf"about \d+-\d+ s: {sources} of {sources} sources to compile on \d+ cores\) into "
                     rf"{re.escape(str(tmp_path / 'cache' / 'moeserve' / 'kernels'))}", lines[announce[0]])
    counts = sorted(int(m.group(1)) for line in lines[announce[0]:]
                    if (m := re.search(rf"kernels: compiled \w+\.cpp \((\d+) of {sources}, \d+ s\)", line)))
    assert counts == list(range(1, sources + 1))  # every source once, counted in order of finishing
    errors = [line for line in lines if line.startswith("error:")]  # the empty library does not load
    assert proc.returncode == 1 and len(errors) == 1 and "C++ kernels not built:" in errors[0]
    assert "Traceback" not in proc.stderr


def test_no_compiler_is_one_line(tmp_path: Path) -> None:
    proc = build_kernels(tmp_path, "no-such-compiler")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "error: C++ kernels not built: C++ compiler 'no-such-compiler' not found (set CXX or install g++) (the "
        "engine will run torch's ops; kernels=cpp will refuse to start)"]


def test_build_kernels_in_this_process(capsys) -> None:
    status = kernels.load(suite_isa())  # built or cached by the rest of the suite where a compiler exists
    assert main(["build-kernels"]) == (0 if status.available else 1)
    if status.available:
        assert capsys.readouterr().out == f"C++ kernels ready: {status.reason}\n"


def test_the_load_time_leaves_the_kernel_build_out(tiny_text_model, monkeypatch, caplog) -> None:
    """A build that takes a second (a stand-in: kernels.choose sleeps): the engine's load time leaves it out and
    the line says how long it took."""
    from moeserve.config import EngineSettings, build_settings
    from moeserve.engine.llm_engine import LLMEngine

    def slow_choose(setting: str, device_type: str = "cpu", isa: str = "auto") -> tuple[bool, str]:
        time.sleep(1.0)
        return False, "kernels=torch"

    monkeypatch.setattr(kernels, "choose", slow_choose)
    settings = build_settings(EngineSettings, {"model": str(tiny_text_model), "kernels": "torch"}, environ={})
    with caplog.at_level(logging.INFO, logger="moeserve"):
        start = time.monotonic()
        engine = LLMEngine(settings)
        wall = time.monotonic() - start
    assert engine.kernel_seconds >= 1.0
    assert engine.load_seconds <= wall - 1.0
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("Loading weights took"))
    assert line.endswith(f"; the C++ kernels took {engine.kernel_seconds:.0f} s more)")
