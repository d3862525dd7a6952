"""Memory budgets with their reasons (the engine logs them at start-up): the headroom rule for a budget derived
from free memory and the host RAM tier. The fast tier itself (expert
cache, KV pool) is split by memory/split.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from moeserve.errors import ConfigError
from moeserve.memory.chunks import (
    STAGING_BUFFERS,
    capacity_within,
    fmt_bytes,
    plan_chunks,
    staging_pinned_bytes,
)

if TYPE_CHECKING:
    from moeserve.memory.topology import MemoryTopology

GiB = 1024**3
# Headroom kept free for activations, allocator slack, the Python heap and the OS when moeserve picks budgets
# on its own: a fraction of available memory plus a fixed floor.
HEADROOM_FRACTION = 0.10
HEADROOM_MIN_BYTES = 1 * GiB


@dataclass(frozen=True)
class HostBudget:
    capacity: int  # experts held in the host RAM tier (0 = no host tier)
    cache_bytes: int  # what its power-of-two chunks take, slack included (memory/pinned.py)
    reason: str
    staging_bytes: int = 0  # the copier's pinned staging buffers in host RAM (a CUDA device; rounding included)


def host_headroom_bytes(available_bytes: int) -> int:
    """RAM a host tier leaves free: pinned pages cannot be swapped or reclaimed, so the rest of the process and
    the OS keep the same headroom as a derived budget."""
    return max(HEADROOM_MIN_BYTES, int(available_bytes * HEADROOM_FRACTION))


def choose_host_budget(host_cache_gb: float | None, unit_nbytes: int, total_experts: int, fast_capacity: int,
                       topology: MemoryTopology) -> HostBudget:
    """Host RAM tier between the device slots and disk: only on a discrete CUDA device, and only when the fast
    tier does not already hold every expert. Counted in whole power-of-two chunks (memory/pinned.py). Default: as
    much of free RAM as the experts need, less headroom and the copier's pinned staging buffers (on any CUDA
    device, counted in `staging_bytes` and named in the reason); an explicit host_cache_gb above that is refused
    (ConfigError, one line naming the numbers)."""
    if topology.device_type != "cuda":
        why = "" if not host_cache_gb else f" (host_cache_gb={host_cache_gb:g} ignored)"
        return HostBudget(0, 0, f"no host tier: on CPU the fast tier is RAM{why}")
    staging = staging_pinned_bytes(unit_nbytes)
    pinned = f"; copier staging {STAGING_BUFFERS} x {fmt_bytes(staging // STAGING_BUFFERS)} pinned"
    if topology.unified:
        why = "unified memory is one pool, all of it budgeted by expert_cache_gb (staging in its read buffers)"
        return HostBudget(0, 0, f"no host tier: {why}{pinned}", staging)
    if fast_capacity >= total_experts:
        return HostBudget(0, 0, f"no host tier: every expert is in GPU memory{pinned}", staging)
    if host_cache_gb == 0:
        return HostBudget(0, 0, f"no host tier: host_cache_gb=0, set (misses are read from disk){pinned}", staging)
    free = topology.host_free_bytes
    headroom = host_headroom_bytes(free)
    lockable = max(0, free - headroom - staging)
    ram = f"{fmt_bytes(free)} available less {fmt_bytes(headroom)} headroom and {fmt_bytes(staging)} staging"
    if host_cache_gb is not None:
        capacity = capacity_within(int(host_cache_gb * GiB), unit_nbytes, total_experts)
        chunks = plan_chunks(capacity, unit_nbytes)
        if chunks.nbytes > lockable:
            raise ConfigError(f"host_cache_gb={host_cache_gb:g} needs {fmt_bytes(chunks.nbytes)} of pinned host RAM "
                              f"({capacity} experts in {chunks.describe()}), more than the {fmt_bytes(lockable)} "
                              f"that can be locked safely ({ram}): lower host_cache_gb, or leave it unset to size "
                              "it from free RAM")
        why = f"host_cache_gb={host_cache_gb:g}, set"
    else:
        capacity = capacity_within(lockable, unit_nbytes, total_experts)
        chunks = plan_chunks(capacity, unit_nbytes)
        why = f"auto: {ram}"
    return HostBudget(capacity, chunks.nbytes,
                      f"{capacity} of {total_experts} experts, {fmt_bytes(chunks.nbytes)} in {chunks.describe()}, "
                      f"pinned where the driver allows ({why}){pinned}", staging)
