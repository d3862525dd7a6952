"""The test tiers' rule (tests/tiers.py) stays true: every listed slow path exists, and a test outside the slow tier
that takes too long is listed at the end of the run."""

from __future__ import annotations

from types import SimpleNamespace

from tests import tiers


def test_every_listed_slow_path_is_a_test_module_or_folder() -> None:
    for path, why in tiers.SLOW.items():
        where = tiers.TESTS / path
        assert where.is_dir() or (where.is_file() and where.name.startswith("test_")), f"tests/tiers.py: {path}"
        assert why, f"tests/tiers.py: say why {path} is slow"


def test_a_slow_test_outside_the_slow_tier_is_listed() -> None:
    watch = tiers.SlowFastTests()
    limit = tiers.FAST_TEST_LIMIT_S
    for nodeid, keywords, seconds in (("t.py::quick", {}, 0.1), ("t.py::long", {}, limit * 0.6),
                                      ("t.py::marked", {"slow": 1}, limit * 5)):
        for _ in ("setup", "call"):  # the phases add up: 0.6 + 0.6 of the limit is over it
            watch.pytest_runtest_logreport(SimpleNamespace(nodeid=nodeid, keywords=keywords, duration=seconds))
    lines: list[str] = []
    reporter = SimpleNamespace(section=lines.append, write_line=lines.append)
    watch.pytest_terminal_summary(reporter)
    assert len(lines) == 3 and "t.py::long" in lines[1]
    assert not any("t.py::quick" in line or "t.py::marked" in line for line in lines)
