"""The memory plan of a model on this machine, computed from shapes alone (nothing is loaded).

Every byte has an owner: resident weights (everything but experts), the KV cache, the runtime (interpreter,
torch, activations), the expert cache in the fast tier, the host tier (discrete CUDA only). Given a total budget
(`--memory-gb`), the expert cache gets what is left; without one, the engine's own rule (free memory less
headroom) decides. The plan refuses when even the resident part does not fit.

Speed ceilings for decode (batch 1), from bytes per token and measured bandwidths:
- fast tier: every resident weight but the embedding table (one row) plus top-k experts per MoE layer;
- worst case: additionally every expert missed, read from the slower tier;
- uniform routing: misses at the rate 1 - cache fraction (real routing is skewed, so usually better).
"""

from __future__ import annotations

from dataclasses import dataclass

from moeserve.errors import ConfigError
from moeserve.memory.budget import GiB, HostBudget, choose_expert_budget, choose_host_budget

RUNTIME_OVERHEAD_BYTES = GiB // 2  # interpreter + torch + activations of a step, charged to --memory-gb


@dataclass(frozen=True)
class ModelFootprint:
    """Sizes of one model in the compute dtype, from its checkpoint header."""

    resident_bytes: int  # non-expert weights
    embed_bytes: int  # the embedding table (decode reads one row of it)
    hidden_bytes: int  # one row of the embedding (hidden_size x dtype)
    kv_bytes: int
    unit_nbytes: int  # one expert in the fast tier
    stored_unit_nbytes: int  # one expert on disk
    num_moe_layers: int
    num_experts: int  # per MoE layer
    top_k: int

    @property
    def total_experts(self) -> int:
        return self.num_moe_layers * self.num_experts


@dataclass(frozen=True)
class MemoryPlan:
    footprint: ModelFootprint
    capacity: int  # experts in the fast tier
    cache_reason: str
    host: HostBudget
    memory_bytes: int | None  # the total budget given, if any

    @property
    def cache_bytes(self) -> int:
        return self.capacity * self.footprint.unit_nbytes

    @property
    def experts_per_layer(self) -> float:
        return min(self.capacity / self.footprint.num_moe_layers, self.footprint.num_experts)

    @property
    def fast_bytes_per_token(self) -> int:
        f = self.footprint
        return f.resident_bytes - f.embed_bytes + f.hidden_bytes + f.num_moe_layers * f.top_k * f.unit_nbytes

    @property
    def worst_disk_bytes_per_token(self) -> int:
        """Every active expert missed in every tier above disk (0 when everything is resident)."""
        f = self.footprint
        if self.capacity >= f.total_experts or self.host.capacity >= f.total_experts:
            return 0
        return f.num_moe_layers * f.top_k * f.stored_unit_nbytes

    @property
    def worst_host_bytes_per_token(self) -> int:
        f = self.footprint
        if self.host.capacity == 0 or self.capacity >= f.total_experts:
            return 0
        return f.num_moe_layers * f.top_k * f.unit_nbytes

    @property
    def uniform_hit_rate(self) -> float:
        return min(1.0, self.capacity / self.footprint.total_experts)


def make_plan(
    footprint: ModelFootprint,
    memory_gb: float | None,
    expert_cache_gb: float | None,
    host_cache_gb: float | None,
    device_type: str,
    unified: bool,
    available_bytes: int | None = None,
) -> MemoryPlan:
    """Size the tiers for `footprint`. Raises ConfigError when the resident part alone exceeds `memory_gb`."""
    f = footprint
    fixed = f.resident_bytes + f.kv_bytes + RUNTIME_OVERHEAD_BYTES
    memory_bytes = None if memory_gb is None else int(memory_gb * GiB)
    derived = memory_bytes is not None and expert_cache_gb is None  # the cache gets what --memory-gb leaves
    if memory_bytes is not None:
        if fixed > memory_bytes:
            raise ConfigError(
                f"does not fit: resident weights {f.resident_bytes / GiB:.2f} GiB + KV cache {f.kv_bytes / GiB:.2f} "
                f"GiB + runtime {RUNTIME_OVERHEAD_BYTES / GiB:.2f} GiB = {fixed / GiB:.2f} GiB exceed "
                f"--memory-gb {memory_gb:g}; lower max_model_len / max_num_seqs or give more memory")
        room = memory_bytes - fixed
        if expert_cache_gb is None:
            expert_cache_gb = room / GiB
        elif expert_cache_gb * GiB > room:
            raise ConfigError(f"expert_cache_gb={expert_cache_gb:g} does not fit in --memory-gb {memory_gb:g}: "
                              f"only {room / GiB:.2f} GiB is left after the resident part")
    budget = choose_expert_budget(expert_cache_gb, f.unit_nbytes, f.total_experts,
                                  f.resident_bytes + f.kv_bytes, available_bytes)
    reason = budget.reason
    if derived and expert_cache_gb is not None and " holds" in reason:
        reason = f"--memory-gb {memory_gb:g} leaves {expert_cache_gb:.2f} GiB after the resident part; it" \
            + reason[reason.index(" holds"):]
    host = choose_host_budget(host_cache_gb, f.unit_nbytes, f.total_experts, budget.capacity, device_type,
                              unified, available_bytes)
    return MemoryPlan(f, budget.capacity, reason, host, memory_bytes)


def decode_ceiling(plan: MemoryPlan, fast_bw: float | None, host_bw: float | None, disk_bw: float | None,
                   miss_rate: float) -> float | None:
    """Tokens/s bound at batch 1 when a `miss_rate` share of active experts comes from the slower tiers
    (from the host tier when there is one, else from disk). None when a needed bandwidth is unknown."""
    if fast_bw is None:
        return None
    seconds = plan.fast_bytes_per_token / fast_bw
    host_bytes, disk_bytes = plan.worst_host_bytes_per_token, plan.worst_disk_bytes_per_token
    # The worst case is the slowest tier: disk unless the host tier holds every expert.
    slow_bytes, slow_bw = (disk_bytes, disk_bw) if disk_bytes else (host_bytes, host_bw)
    if slow_bytes and miss_rate:
        if slow_bw is None:
            return None
        seconds += miss_rate * slow_bytes / slow_bw
    return 1.0 / seconds
