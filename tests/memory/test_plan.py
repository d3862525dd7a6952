"""The memory plan: tier sizes, refusal when the resident part does not fit, bytes per token and ceilings."""

from __future__ import annotations

import pytest

from moeserve.cli import main
from moeserve.config import EngineSettings
from moeserve.errors import ConfigError
from moeserve.memory.budget import GiB
from moeserve.memory.plan import ModelFootprint, decode_ceiling, make_plan
from moeserve.memory.split import MemoryNeeds, kv_for, split_memory
from moeserve.memory.topology import MemoryTopology

MiB = 2**20
FOOT = ModelFootprint(resident_bytes=1 * GiB, embed_bytes=256 * MiB, hidden_bytes=8 * 1024, unit_nbytes=16 * MiB,
                      stored_unit_nbytes=16 * MiB, num_moe_layers=10, num_experts=64, top_k=4)
NEEDS = MemoryNeeds(resident_bytes=GiB, unit_nbytes=16 * MiB, total_experts=640, kv_bytes_per_token=4096,
                    kv_fixed_bytes=0, block_size=16, model_max_len=4096, staging_bytes=64 * MiB,
                    overhead_bytes=GiB // 2)


CPU = MemoryTopology("cpu", False, 100 * GiB, 100 * GiB, 128 * GiB, "CPU")


def plan(memory_gb: float | None, expert_cache_gb: float | None = None):  # noqa: ANN201
    return make_plan(FOOT, NEEDS, CPU, EngineSettings(memory_gb=memory_gb, expert_cache_gb=expert_cache_gb))


def test_the_plan_is_the_engine_split():
    p = plan(4.0)
    same = split_memory(NEEDS, memory_gb=4.0, expert_cache_gb=None, kv_cache_gb=None, max_model_len=None,
                        max_num_seqs=8, free_bytes=100 * GiB)
    assert p.split == same and p.memory_bytes == 4 * GiB
    room = 4 * GiB - GiB - 64 * MiB - GiB // 2
    assert p.split.kv_bytes == kv_for(NEEDS, 4096) == 4096 * (4096 + 16)  # the experts do not all fit: one sequence
    assert p.capacity == (room - p.split.kv_bytes) // FOOT.unit_nbytes == 154
    assert p.cache_bytes == 154 * 16 * MiB
    assert p.experts_per_layer == 15.4
    assert p.worst_disk_bytes_per_token == 10 * 4 * 16 * MiB
    assert p.fast_bytes_per_token == GiB - 256 * MiB + 8 * 1024 + 10 * 4 * 16 * MiB
    assert p.uniform_hit_rate == 154 / 640
    assert p.host.capacity == 0


def test_refuses_what_the_engine_refuses():
    with pytest.raises(ConfigError, match="does not fit: resident weights 1.00 GiB"):
        plan(1.5)
    with pytest.raises(ConfigError, match=r"expert_cache_gb=3\).* exceed memory_gb=4; lower expert_cache_gb"):
        plan(4.0, 3.0)


def test_ceilings_follow_bytes_over_bandwidth():
    p = plan(4.0)
    fast, disk = 10e9, 1e9
    assert decode_ceiling(p, fast, None, disk, 0.0) == pytest.approx(fast / p.fast_bytes_per_token)
    worst = 1 / (p.fast_bytes_per_token / fast + p.worst_disk_bytes_per_token / disk)
    assert decode_ceiling(p, fast, None, disk, 1.0) == pytest.approx(worst)
    assert decode_ceiling(p, None, None, disk, 1.0) is None
    resident = plan(64.0)
    assert resident.capacity == 640 and resident.worst_disk_bytes_per_token == 0


def test_cli_plan_prints_the_plan_without_loading(tiny_checkpoint, capsys):
    folder = tiny_checkpoint("qwen3_moe")
    assert main(["plan", str(folder), "--memory-gb", "0.6", "--max-model-len", "64", "--max-num-seqs", "1"]) == 0
    out = capsys.readouterr().out
    for needle in ("memory budget: 614.4 MiB (memory_gb=0.6, set): resident weights", "KV pool: ", "placement: ",
                   "max_model_len: 64 (set)", "runtime: 512 MiB stated", "per layer of 8", "from disk",
                   "bandwidth: RAM copy", "decode ceiling"):
        assert needle in out


def test_cli_plan_memory_gb_is_the_engine_setting(tiny_checkpoint, capsys, monkeypatch):
    """--memory-gb is the engine's memory_gb (one definition), so MOESERVE_MEMORY_GB sets it too; plan prints the
    lines the engine logs for the same settings."""
    folder = tiny_checkpoint("qwen3_moe")
    monkeypatch.setenv("MOESERVE_MEMORY_GB", "0.7")
    assert main(["plan", str(folder), "--no-probe", "--max-model-len", "64"]) == 0
    assert "memory budget: 716.8 MiB (memory_gb=0.7, set)" in capsys.readouterr().out


def test_cli_plan_refuses_in_one_line(tiny_checkpoint, capsys):
    folder = tiny_checkpoint("qwen3_moe")
    assert main(["plan", str(folder), "--memory-gb", "0.1", "--no-probe"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: does not fit") and "\n" not in err


def test_cli_plan_runtime_line_without_memory_gb(tiny_checkpoint, capsys):
    """Without memory_gb the stated RSS is not in the split (free memory excludes it): the runtime line gives the
    activations alone (it printed the activations less the stated RSS, a negative figure, before)."""
    folder = tiny_checkpoint("qwen3_moe")
    assert main(["plan", str(folder), "--no-probe", "--max-model-len", "64"]) == 0
    [line] = [x for x in capsys.readouterr().out.splitlines() if x.startswith("runtime: ")]
    assert "the serving process's own RSS is outside free memory, not charged" in line and "-" not in line
