"""docs/extending.md's commands run as written: every line of its ```bash blocks is run from the repository root and
must exit 0 (each prints the registry a section adds to, or runs the tests that section says to copy). Every test
file a pytest command names must exist. Slow: the commands together take a minute or two."""

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


@pytest.mark.slow
@pytest.mark.parametrize("command", COMMANDS)
def test_command_runs_as_written(command: str) -> None:
    done = subprocess.run(command, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
