"""`moeserve bench VARIANT`: every variant has its own --help, takes the log flags, and refuses a bad name, flag or
value in one line naming the closest (the slow tier runs each one: tests/research/test_research_scripts.py)."""

from __future__ import annotations

import pytest

from moeserve.bench.variants import VARIANTS
from moeserve.cli import main

NAMES = [v.replace("_", "-") for v in VARIANTS]


def _exit_code(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return int(exit_info.value.code or 0)


@pytest.mark.parametrize("name", NAMES)
def test_each_variant_has_its_help(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["bench", name, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: moeserve bench {name}") and "--log-level" in out


def test_bench_help_lists_the_variants(capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in NAMES)


@pytest.mark.parametrize(("argv", "expected"), [
    (["bench", "ofload"], "invalid choice: 'ofload' (did you mean 'offload'?)"),
    (["bench", "offload", "--tokns", "3"], "unrecognized arguments: --tokns 3 (did you mean --tokens?)"),
    (["bench", "commits"], "the following arguments are required: OTHER"),
    (["bench", "batch-invariance", "--dims", "gpt-oss-2b"], "invalid choice: 'gpt-oss-2b' (did you mean"),
])
def test_a_bad_variant_or_flag_names_the_closest(argv: list[str], expected: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(argv) == 2
    assert expected in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "expected"), [
    (["bench", "offload", "--policies", "lru,lfruu"], "--policies: unknown policy 'lfruu' (did you mean 'lfru'?)"),
    (["bench", "checksum", "--units", "0"], "--units must be positive (got 0)"),
    (["bench", "serve", "--concurrency", "-1"], "--concurrency must be positive (got -1)"),
    (["bench", "route-trace", "--trace", "no-such.jsonl"], "--trace no-such.jsonl: no such file or folder"),
    (["bench", "batch-invariance", "--model", "x", "--mxfp4"], "give --model or --mxfp4, not both"),
    (["bench", "sequence-memory", "--items", "0"], "figures are numbered 1-5"),
])
def test_a_bad_value_is_one_line(argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 1
    assert expected in capsys.readouterr().err
