"""The test tiers' rule (tests/tiers.py) stays true: every listed slow path exists, and a test outside the slow tier
that takes too long is listed at the end of the run."""

from __future__ import annotations

import ast
from types import SimpleNamespace
from typing import Any

from tests import tiers


def test_every_listed_slow_entry_exists() -> None:
    """A listed folder, module or test that was moved or renamed would quietly put its tests back in the fast tier."""
    for entry, why in tiers.SLOW.items():
        path, _, test = entry.partition("::")
        where = tiers.TESTS / path
        assert where.is_dir() or (where.is_file() and where.name.startswith("test_")), f"tests/tiers.py: {entry}"
        if test:
            defined = {node.name for node in ast.parse(where.read_text()).body
                       if isinstance(node, ast.FunctionDef | ast.ClassDef)}
            assert test in defined, f"tests/tiers.py: no {test} in {path}"
        assert why, f"tests/tiers.py: say why {entry} is slow"


def test_a_listed_module_or_test_is_slow_and_its_neighbours_are_not() -> None:
    entry = next(e for e in tiers.SLOW if "::" in e)
    module, _, test = entry.partition("::")

    def item(nodeid: str) -> Any:
        return SimpleNamespace(path=tiers.TESTS / module, nodeid=nodeid)

    assert tiers.listed(item(f"tests/{module}::{test}"))
    assert tiers.listed(item(f"tests/{module}::{test}[param-1]"))
    assert not tiers.listed(item(f"tests/{module}::{test}_and_more"))
    assert not tiers.listed(item(f"tests/{module}::test_something_else"))
    folder = next(e for e in tiers.SLOW if "::" not in e)
    assert tiers.listed(SimpleNamespace(path=tiers.TESTS / folder, nodeid=f"tests/{folder}::test_x"))


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
