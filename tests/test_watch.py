"""tests/watch.py: in a pytest run of its own (-q, as CI runs), a failure is named the moment it happens, a long
test the moment it ends, and a hung test is stopped at the guard with every thread's stack, the run going on."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CONFTEST = """
from tests import watch

def pytest_configure(config):
    config.pluginmanager.register(watch.RunWatch(config, hang_s=3, long_s=0.5), "watch-under-test")
"""

TESTS = """
import time

def test_a_fails():
    assert 1 + 1 == 3, "one plus one"

def test_b_hangs():
    time.sleep(60)

def test_c_is_long():
    time.sleep(0.7)

def test_d_passes():
    pass
"""


def test_failures_long_tests_and_hangs_are_named_as_they_happen(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_sample.py").write_text(TESTS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    t0 = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                          str(tmp_path)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    out = run.stdout + run.stderr
    assert time.monotonic() - t0 < 50, out  # the 60 s sleep was stopped at the 3 s guard
    lines = out.splitlines()
    failed_a = next(i for i, line in enumerate(lines) if line.startswith("FAILED test_sample.py::test_a_fails (call"))
    assert "one plus one" in lines[failed_a]
    hung = next(i for i, line in enumerate(lines) if line.startswith("FAILED test_sample.py::test_b_hangs (call"))
    assert "hang guard of 3 s" in lines[hung]
    assert "in test_b_hangs" in out.split("Timeout (", 1)[-1]  # faulthandler's stack dump shows where it hung
    long_c = next(i for i, line in enumerate(lines) if line.startswith("long test: test_sample.py::test_c_is_long"))
    summary = next(i for i, line in enumerate(lines) if "short test summary" in line or " failed" in line)
    assert failed_a < hung < long_c < summary  # each said as it happened, before the summary
    assert "2 failed, 2 passed" in out
