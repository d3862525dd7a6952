"""Budgets: explicit, from free memory, the host tier, and unified memory as one budget."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from moeserve.memory.budget import GiB, choose_host_budget
from moeserve.memory.topology import detect_topology

UNIT = 64 * 2**20  # one expert: 64 MiB


def test_host_tier_only_on_discrete_cuda():
    cpu = choose_host_budget(4.0, UNIT, 100, 10, "cpu", unified=False)
    assert cpu.capacity == 0 and "ignored" in cpu.reason
    unified = choose_host_budget(4.0, UNIT, 100, 10, "cuda", unified=True)
    assert unified.capacity == 0 and "one pool" in unified.reason
    discrete = choose_host_budget(4.0, UNIT, 100, 10, "cuda", unified=False)
    assert discrete.capacity == 64
    auto = choose_host_budget(None, UNIT, 100, 10, "cuda", unified=False, available_bytes=5 * GiB)
    assert auto.capacity == (5 * GiB - GiB) // UNIT  # 1 GiB headroom floor
    assert choose_host_budget(None, UNIT, 100, 100, "cuda", unified=False).capacity == 0  # all on the GPU


def test_topology_unified_memory_is_one_budget():
    integrated = SimpleNamespace(name="NVIDIA GB10", is_integrated=1)
    t = detect_topology(torch.device("cuda"), cuda_props=integrated, host_free_bytes=100 * GiB)
    assert t.unified and t.fast_free_bytes == t.host_free_bytes == 100 * GiB and "one" in t.reason
    discrete = SimpleNamespace(name="NVIDIA H100", is_integrated=0)
    t = detect_topology(torch.device("cuda"), cuda_props=discrete, cuda_free_bytes=70 * GiB, host_free_bytes=GiB)
    assert not t.unified and t.fast_free_bytes == 70 * GiB and t.host_free_bytes == GiB
    assert detect_topology(torch.device("cpu"), host_free_bytes=GiB).fast_free_bytes == GiB
