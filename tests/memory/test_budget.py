"""Budgets: the host tier (discrete CUDA only, in pinned power-of-two chunks, host_cache_gb checked against RAM)."""

from __future__ import annotations

import pytest

from moeserve.errors import ConfigError
from moeserve.memory.budget import GiB, choose_host_budget
from moeserve.memory.chunks import plan_chunks
from moeserve.memory.topology import MemoryTopology

MiB = 2**20
UNIT = 64 * MiB  # one expert: 64 MiB (4 per 256 MiB chunk, no slack)


def topo(kind: str = "discrete", host_free: int = 100 * GiB) -> MemoryTopology:
    device = "cpu" if kind == "cpu" else "cuda"
    return MemoryTopology(device, kind == "unified", 16 * GiB, host_free, 128 * GiB, kind)


def test_host_tier_only_on_discrete_cuda():
    cpu = choose_host_budget(4.0, UNIT, 100, 10, topo("cpu"))
    assert cpu.capacity == 0 and "ignored" in cpu.reason
    unified = choose_host_budget(4.0, UNIT, 100, 10, topo("unified"))
    assert unified.capacity == 0 and "one pool" in unified.reason
    discrete = choose_host_budget(4.0, UNIT, 100, 10, topo())
    assert discrete.capacity == 64 and discrete.cache_bytes == 4 * GiB and "host_cache_gb=4, set" in discrete.reason
    auto = choose_host_budget(None, UNIT, 100, 10, topo(host_free=5 * GiB))
    # 1 GiB headroom floor and the copier's two 64 MiB staging buffers; 256 MiB chunks of 4 units, no slack
    assert auto.capacity == (5 * GiB - GiB - 2 * UNIT) // UNIT
    assert "auto: 5.00 GiB available less 1.00 GiB headroom and 128.0 MiB staging" in auto.reason
    assert choose_host_budget(None, UNIT, 100, 100, topo()).capacity == 0  # all on the GPU
    off = choose_host_budget(0.0, UNIT, 100, 10, topo())
    assert off.capacity == 0 and off.reason == ("no host tier: host_cache_gb=0, set (misses are read from disk); "
                                                "copier staging 2 x 64.0 MiB pinned")


def test_the_chunks_slack_is_counted_in_the_budget():
    """A 100 MiB unit: 256 MiB chunks would waste 56 of 256, 512 MiB ones 12 of 512, 1 GiB ones 24 of 1024: the
    tier is in 512 MiB chunks of 5 units, and what the budget counts is the chunks' bytes, not capacity x unit."""
    unit = 100 * MiB
    host = choose_host_budget(4.0, unit, 1000, 1, topo())
    chunks = plan_chunks(host.capacity, unit)
    assert set(chunks.chunk_nbytes) == {512 * MiB} and host.capacity == 40  # 8 chunks x 5 units = exactly 4 GiB
    assert host.cache_bytes == chunks.nbytes == 4 * GiB > host.capacity * unit
    assert "40 of 1000 experts, 4.00 GiB in 8 chunks (8 x 512.0 MiB; 96.0 MiB slack)" in host.reason
    auto = choose_host_budget(None, unit, 1000, 1, topo(host_free=10 * GiB))  # 9 GiB less 256 MiB of staging
    assert auto.cache_bytes <= 9 * GiB - 256 * MiB < plan_chunks(auto.capacity + 1, unit).nbytes


def test_an_explicit_host_cache_beyond_ram_is_refused_in_one_line():
    with pytest.raises(ConfigError) as err:
        choose_host_budget(100.0, UNIT, 10_000, 10, topo(host_free=64 * GiB))
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("host_cache_gb=100 needs 100.00 GiB of pinned host RAM (1600 experts in 400 chunks")
    assert ("more than the 57.48 GiB that can be locked safely (64.00 GiB available less 6.40 GiB headroom and "
            "128.0 MiB staging)") in msg
    # capped at what the model has: 100 GiB asked, 10 experts needed, no refusal
    small = choose_host_budget(100.0, UNIT, 10, 1, topo(host_free=8 * GiB))
    assert small.capacity == 10 and small.cache_bytes == 640 * MiB  # 2 x 256 MiB of 4 units + 2 units in 128 MiB


@pytest.mark.parametrize("kind", ["discrete", "unified"])
def test_the_copiers_staging_buffers_are_counted_and_logged_on_cuda(kind: str):
    """Two pinned staging buffers of one unit each, rounded up to a power of two by torch's pinned allocator (a
    100 MiB unit pins 128 MiB): on a discrete GPU out of the RAM a host tier may lock, on unified memory out of
    the one pool (memory/sizing.py adds them to the split's read buffers); on the CPU there are none."""
    unit = 100 * MiB
    host = choose_host_budget(None, unit, 1000, 1, topo(kind, host_free=10 * GiB))
    assert host.staging_bytes == 2 * 128 * MiB and "copier staging 2 x 128.0 MiB pinned" in host.reason
    if kind == "discrete":  # 9 GiB lockable less 256 MiB of staging
        assert host.cache_bytes <= 9 * GiB - 256 * MiB < plan_chunks(host.capacity + 1, unit).nbytes
    assert choose_host_budget(None, unit, 1000, 1, topo("cpu")).staging_bytes == 0
