"""Memory budgets with their reasons (the engine logs them at start-up): the headroom rule for a budget derived
from free memory and the host RAM tier. The fast tier itself (expert
cache, KV pool) is split by memory/split.py."""

from __future__ import annotations

from dataclasses import dataclass

import psutil

GiB = 1024**3
# Headroom kept free for activations, allocator slack, the Python heap and the OS when moeserve picks budgets
# on its own: a fraction of available memory plus a fixed floor.
HEADROOM_FRACTION = 0.10
HEADROOM_MIN_BYTES = 1 * GiB


@dataclass(frozen=True)
class ExpertBudget:
    capacity: int  # experts held in the fast tier
    cache_bytes: int
    reason: str


def available_memory_bytes() -> int:
    """Memory the OS could give us now (MemAvailable), not counting what we already hold."""
    return int(psutil.virtual_memory().available)


@dataclass(frozen=True)
class HostBudget:
    capacity: int  # experts held in the host RAM tier (0 = no host tier)
    cache_bytes: int
    reason: str


def choose_host_budget(
    host_cache_gb: float | None,
    unit_nbytes: int,
    total_experts: int,
    fast_capacity: int,
    device_type: str,
    unified: bool,
    available_bytes: int | None = None,
) -> HostBudget:
    """Host RAM tier between the device slots and disk: only on a discrete CUDA device, and only when the fast
    tier does not already hold every expert. Default: as much of free RAM as the experts need, less headroom."""
    if device_type != "cuda":
        why = "" if not host_cache_gb else f" (host_cache_gb={host_cache_gb:g} ignored)"
        return HostBudget(0, 0, f"no host tier: on CPU the fast tier is RAM{why}")
    if unified:
        return HostBudget(0, 0, "no host tier: unified memory is one pool, all of it budgeted by expert_cache_gb")
    if fast_capacity >= total_experts:
        return HostBudget(0, 0, "no host tier: every expert is in GPU memory")
    if host_cache_gb is not None:
        capacity = min(total_experts, int(host_cache_gb * GiB) // unit_nbytes)
        return HostBudget(capacity, capacity * unit_nbytes,
                          f"host_cache_gb={host_cache_gb:g} holds {capacity} of {total_experts} experts")
    free = available_memory_bytes() if available_bytes is None else available_bytes
    headroom = max(HEADROOM_MIN_BYTES, int(free * HEADROOM_FRACTION))
    capacity = max(0, min(total_experts, (free - headroom) // unit_nbytes))
    return HostBudget(capacity, capacity * unit_nbytes,
                      f"host tier of {capacity} of {total_experts} experts ({capacity * unit_nbytes / GiB:.2f} GiB) "
                      f"from {free / GiB:.1f} GiB free RAM ({headroom / GiB:.1f} GiB kept as headroom)")
