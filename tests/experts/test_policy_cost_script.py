"""research/policy_cost.py: the deeper-cycle replay (`--stack`) keeps every call and numbers the layers apart; a run
prints a row per policy, the same hit rate for the default policy of HEAD (`--before`) as for today's."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from moeserve.experts.calls import LayerCall

ROOT = Path(__file__).resolve().parents[2]
DEMO_TRACE = ROOT / "tests" / "experts" / "data" / "demo-batch1.jsonl"


def load_script():  # noqa: ANN201
    spec = importlib.util.spec_from_file_location("policy_cost", ROOT / "research" / "policy_cost.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stacked_steps_side_by_side_are_one_step_of_more_layers() -> None:
    steps = [[LayerCall(0, (t,)), LayerCall(2, (t + 10,))] for t in range(7)]
    calls = load_script().stacked(steps, 3)  # 2 whole groups of 3 steps; the 7th step is left out
    assert [(c.layer, c.expert_ids) for c in calls[:6]] == [(0, (0,)), (2, (10,)), (3, (1,)), (5, (11,)),
                                                            (6, (2,)), (8, (12,))]
    assert len(calls) == 12 and calls[6] == LayerCall(0, (3,))


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="not a git checkout")
def test_a_run_times_today_and_heads_default_policy_with_the_same_hits() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "research" / "policy_cost.py"), str(DEMO_TRACE), "--capacity",
                          "12", "--rounds", "1", "--policy", "lru,lfru", "--before", "HEAD", "--stack", "2"],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:] if "(deferred)" not in line}
    assert set(rows) == {"lru", "lfru", "lfru@HEAD"}
    assert "of 8 layers" in out
    assert rows["lfru"][1] == rows["lfru@HEAD"][1]  # hit rate: the same decisions
