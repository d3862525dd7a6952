"""What start-up says: every choice with its reason and one summary line at INFO (`chat` shows only the summary), load progress as log lines when stderr is
not a terminal, `serve`'s address and model at any log level, and `chat` in at most 5 lines before the prompt."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moeserve.engine.startup_log import PROGRESS_LOG_S, LoadProgress
from tests.cpu_emulation import child_pythonpath
from tests.server.conftest import MODEL_NAME, REPO, start_subprocess_server, wait_healthy


def test_load_progress_is_log_lines_off_a_terminal(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    with caplog.at_level(logging.INFO, logger="moeserve"), LoadProgress(4 * 2**30, tty=False,
                                                                         clock=lambda: now[0]) as advance:
        advance(2**30)  # quick: no line
        now[0] = PROGRESS_LOG_S
        advance(2**30)
        now[0] += 1
        advance(2**30)  # within the interval: no line
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"Loading weights: 2.00 GiB of 4.00 GiB (50%) in {PROGRESS_LOG_S:.0f} s"]


def _run(argv: list[str], stdin: str = "") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": child_pythonpath(REPO)}
    env.pop("MOESERVE_LOG_LEVEL", None)
    return subprocess.run([sys.executable, "-m", "moeserve", *argv], input=stdin, capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=600)


def test_chat_says_at_most_five_lines_before_the_prompt(tiny_text_model: Path) -> None:
    out = _run(["chat", str(tiny_text_model), "--dtype", "float32", "--threads", "1"], stdin="/exit\n")
    assert out.returncode == 0, out.stderr
    lines = [line for line in (out.stderr + out.stdout).splitlines() if line.strip()]
    assert len(lines) <= 5, lines
    assert any(line.startswith("sampling: ") for line in lines)
    assert any("Qwen3MoeForCausalLM on cpu, float32, 1 threads" in line and "max_model_len" in line
               for line in lines)
    assert not any(" placement: " in line for line in lines)  # chat quiets the choice lines below DEBUG


def test_serve_prints_its_address_and_model_at_any_log_level(tiny_text_model: Path) -> None:
    proc, url = start_subprocess_server(tiny_text_model, "--log-level", "warning")
    try:
        wait_healthy(url, proc=proc)
    finally:
        proc.terminate()
        out = proc.communicate(timeout=120)[0]
    assert f"moeserve: serving model '{MODEL_NAME}' at {url}/v1" in out, out
    assert " INFO " not in out, out
