"""The two test tiers, and the rule that sorts a test into one of them.

- `make test` runs every test (what CI runs: .ci/run).
- `make test-fast` runs the tests not marked `slow` (`pytest -m "not slow"`): the unit and contract tests, a few
  minutes on 2 cores.

A test is `slow` when it is marked so itself (`@pytest.mark.slow`, a module's `pytestmark`, a slow `pytest.param`)
or when its module or folder is listed in `SLOW` below: modules whose tests each build engines at real dimensions,
serve over HTTP, compare against transformers at length or fuzz, where one test costs seconds to minutes. A module
is listed whole when most of its time is in such tests; a single slow test in an otherwise quick module is marked
where it is written. Per-test durations of the whole suite (`--junitxml`, `--durations=0`) decide which.

So that a new slow test does not quietly make the fast tier slow, every run ends with the tests outside the slow
tier that took longer than `FAST_TEST_LIMIT_S` (setup, call and teardown together: a session fixture's first
build is counted in its first user). Mark such a test `slow`, list its module below, or make it quicker.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

# Paths under tests/ (a module or a folder) whose every test is in the slow tier; the reason for each.
SLOW: dict[str, str] = {
}

FAST_TEST_LIMIT_S = 10.0  # a test outside the slow tier taking longer is listed at the end of the run


def slow_paths() -> list[Path]:
    """The listed paths, resolved under tests/."""
    return [TESTS / p for p in SLOW]


def mark_slow(items: list[pytest.Item]) -> None:
    """Add the `slow` marker to every item whose module lies in a listed path."""
    paths = slow_paths()
    for item in items:
        where = Path(item.path)
        if any(where == p or p in where.parents for p in paths):
            item.add_marker(pytest.mark.slow)


class SlowFastTests:
    """Sums each test's phases and lists, at the end of the run, those outside the slow tier over the limit."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.slow: set[str] = set()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration
        if "slow" in report.keywords:
            self.slow.add(report.nodeid)

    def pytest_terminal_summary(self, terminalreporter) -> None:  # noqa: ANN001 - pytest's TerminalReporter
        over = sorted(((s, n) for n, s in self.seconds.items() if n not in self.slow and s > FAST_TEST_LIMIT_S),
                      reverse=True)
        if not over:
            return
        terminalreporter.section(f"tests outside the slow tier over {FAST_TEST_LIMIT_S:.0f} s (tests/tiers.py)")
        for seconds, nodeid in over:
            terminalreporter.write_line(f"{seconds:7.1f} s  {nodeid}")
        terminalreporter.write_line("mark each slow, list its module in tests/tiers.py SLOW, or make it quicker")
