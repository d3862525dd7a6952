"""What a CI log must show even when the run is cut off: a failure the moment it happens (not only in the summary at
the end), a test that ran long the moment it ends, and a hung test stopped with every thread's stack.

CI keeps only the tail of a run's output and stops it at its time limit. With `-q`, a run that is stopped prints
dots and `F`s and nothing else, so this plugin writes one line per failure as it happens (`FAILED <test> (<phase>,
<s> s): <last line of the error>`), one per test over `LONG_TEST_S`, and stops a test still running after
`HANG_S` (faulthandler dumps every thread's stack first; SIGALRM then raises in the test, which fails and the run
goes on). No test may take that long: it is a hang guard, not a speed limit. With TESTS_TIMES_FILE=FILE, each
test's seconds are appended to FILE as it ends (where the time went, even in a run that was stopped).
"""
from __future__ import annotations

import faulthandler
import os
import signal
import sys
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

HANG_S = 600  # a test still running after this is stopped (a hang: the slowest test takes about a minute)
LONG_TEST_S = 120.0  # a test over this is named the moment it ends
TIMES_VARIABLE = "TESTS_TIMES_FILE"  # a file: each test's seconds (setup + call + teardown) appended as it ends


class TestHung(Exception):
    """Raised in a test that ran past HANG_S."""

    __test__ = False  # not a test class


def _what(report: pytest.TestReport) -> str:
    """The error's first line and where it was raised ('AssertionError: ... (tests/x.py:12)')."""
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        first = crash.message.strip().splitlines()[0] if crash.message.strip() else ""
        return f"{first} ({Path(crash.path).name}:{crash.lineno})"
    text = str(report.longrepr).strip().splitlines() if report.longrepr else [""]
    return text[-1]


class RunWatch:
    """The plugin (registered by tests/conftest.py)."""

    def __init__(self, config: pytest.Config, hang_s: int = HANG_S, long_s: float = LONG_TEST_S) -> None:
        self.config, self.hang_s, self.long_s = config, hang_s, long_s
        self.seconds: dict[str, float] = {}
        self.times_file = os.environ.get(TIMES_VARIABLE)
        # the terminal's stderr, taken before a test's output is captured: a stack dump must reach the log at once
        self.stderr = os.fdopen(os.dup(sys.stderr.fileno()), "w")

    def _stop(self, signum: int, frame: Any) -> None:
        raise TestHung(f"the test ran past the hang guard of {self.hang_s} s (tests/watch.py); every thread's "
                       "stack is printed above it")

    def _say(self, line: str) -> None:
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line("")
            reporter.write_line(line)
        else:
            print(line, file=sys.stderr)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None]:
        guard = hasattr(signal, "SIGALRM")
        if guard:
            faulthandler.dump_traceback_later(max(self.hang_s - 5, self.hang_s / 2), exit=False, file=self.stderr)
            old = signal.signal(signal.SIGALRM, self._stop)
            signal.alarm(self.hang_s)
        try:
            yield
        finally:
            if guard:
                signal.alarm(0)
                signal.signal(signal.SIGALRM, old)
                faulthandler.cancel_dump_traceback_later()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration
        if report.failed:
            self._say(f"FAILED {report.nodeid} ({report.when}, {report.duration:.0f} s): {_what(report)[:300]}")
        if report.when == "teardown" and self.seconds[report.nodeid] > self.long_s:
            self._say(f"long test: {report.nodeid} took {self.seconds[report.nodeid]:.0f} s")
        if report.when == "teardown" and self.times_file:  # each test's seconds as it ends (a run cut off keeps them)
            with open(self.times_file, "a") as f:
                f.write(f"{self.seconds[report.nodeid]:.2f}\t{report.nodeid}\n")
