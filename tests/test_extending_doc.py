"""docs/extending.md's commands run as written: every line of its ```bash blocks is run from the repository root and
must exit 0 (each prints the registry a section adds to, or runs the tests that section says to copy). Every test
file a pytest command names must exist.

A pytest command is run as written plus `--collect-only`: its files, imports, `-k`/`-m` selection (pytest exits 5
when it selects nothing) and options are checked here, and the tests it selects are those of this suite, which runs
them itself (make test): running them a second time in a child pytest was 9 of the 10 minutes these commands took
(load 15). Slow: the commands together take a minute."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "extending.md"


def bash_commands(text: str) -> list[str]:
    """The command lines of the page's ```bash blocks, in order."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M):
        commands += [line.strip() for line in block.splitlines() if line.strip() and not line.startswith("#")]
    return commands


COMMANDS = bash_commands(PAGE.read_text())


def test_the_page_has_commands_for_every_section() -> None:
    sections = len(re.findall(r"^## ", PAGE.read_text(), flags=re.M))
    assert len(COMMANDS) >= sections


def test_bash_commands_reads_only_bash_blocks() -> None:  # a negative control of the extraction
    text = "```bash\necho one\n\necho two\n```\n```python\nprint(3)\n```\n```\nnot run\n```\n"
    assert bash_commands(text) == ["echo one", "echo two"]


@pytest.mark.parametrize("command", [c for c in COMMANDS if " pytest " in c])
def test_every_test_file_named_exists(command: str) -> None:
    files = [a for a in shlex.split(command) if a.startswith("tests/")]
    assert files and all((ROOT / f).exists() for f in files), command


def as_run_here(command: str) -> str:
    """`command`, collect-only where it runs pytest (the suite runs the tests it selects: module docstring)."""
    return f"{command} --collect-only" if " -m pytest " in command else command


@pytest.mark.slow
@pytest.mark.parametrize("command", COMMANDS)
def test_command_runs_as_written(command: str) -> None:
    done = subprocess.run(as_run_here(command), shell=True, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    if " -m pytest " in command:
        assert " collected" in done.stdout, done.stdout[-3000:]  # it did collect: the tests of this suite


def test_pytest_commands_only_are_collect_only() -> None:  # a control of as_run_here
    assert as_run_here(".venv/bin/python -m pytest -q tests/a.py -k x") == \
        ".venv/bin/python -m pytest -q tests/a.py -k x --collect-only"
    assert as_run_here(".venv/bin/moeserve simulate t.jsonl") == ".venv/bin/moeserve simulate t.jsonl"
