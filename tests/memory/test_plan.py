"""The memory plan: tier sizes, refusal when the resident part does not fit, bytes per token and ceilings."""

from __future__ import annotations

import pytest

from moeserve.cli import main
from moeserve.errors import ConfigError
from moeserve.memory.budget import GiB
from moeserve.memory.plan import RUNTIME_OVERHEAD_BYTES, ModelFootprint, decode_ceiling, make_plan

MiB = 2**20
FOOT = ModelFootprint(resident_bytes=1 * GiB, embed_bytes=256 * MiB, hidden_bytes=8 * 1024, kv_bytes=GiB // 2,
                      unit_nbytes=16 * MiB, stored_unit_nbytes=16 * MiB, num_moe_layers=10, num_experts=64,
                      top_k=4)


def test_memory_budget_gives_the_cache_what_the_resident_part_leaves():
    plan = make_plan(FOOT, 4.0, None, None, "cpu", False)
    room = 4 * GiB - GiB - GiB // 2 - RUNTIME_OVERHEAD_BYTES
    assert plan.capacity == room // FOOT.unit_nbytes == 128
    assert plan.experts_per_layer == 12.8
    assert plan.worst_disk_bytes_per_token == 10 * 4 * 16 * MiB
    assert plan.fast_bytes_per_token == GiB - 256 * MiB + 8 * 1024 + 10 * 4 * 16 * MiB
    assert plan.uniform_hit_rate == 128 / 640


def test_refuses_when_the_resident_part_does_not_fit():
    with pytest.raises(ConfigError, match="does not fit: resident weights 1.00 GiB"):
        make_plan(FOOT, 1.5, None, None, "cpu", False)
    with pytest.raises(ConfigError, match="expert_cache_gb=3 does not fit"):
        make_plan(FOOT, 4.0, 3.0, None, "cpu", False)


def test_ceilings_follow_bytes_over_bandwidth():
    plan = make_plan(FOOT, 4.0, None, None, "cpu", False)
    fast, disk = 10e9, 1e9
    assert decode_ceiling(plan, fast, None, disk, 0.0) == pytest.approx(fast / plan.fast_bytes_per_token)
    worst = 1 / (plan.fast_bytes_per_token / fast + plan.worst_disk_bytes_per_token / disk)
    assert decode_ceiling(plan, fast, None, disk, 1.0) == pytest.approx(worst)
    assert decode_ceiling(plan, None, None, disk, 1.0) is None
    resident = make_plan(FOOT, 64.0, None, None, "cpu", False)
    assert resident.worst_disk_bytes_per_token == 0


def test_cli_plan_prints_the_plan_without_loading(tiny_checkpoint, capsys):
    folder = tiny_checkpoint("qwen3_moe")
    assert main(["plan", str(folder), "--memory-gb", "0.6", "--max-model-len", "64", "--max-num-seqs", "1"]) == 0
    out = capsys.readouterr().out
    for needle in ("resident weights", "KV cache", "expert cache", "per layer of 8", "from disk",
                   "bandwidth: RAM copy", "decode ceiling"):
        assert needle in out


def test_cli_plan_refuses_in_one_line(tiny_checkpoint, capsys):
    folder = tiny_checkpoint("qwen3_moe")
    assert main(["plan", str(folder), "--memory-gb", "0.1", "--no-probe"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: does not fit") and "\n" not in err
