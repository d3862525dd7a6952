"""The memory plan of a model on this machine, computed from shapes alone (nothing is loaded).

Every byte has an owner: resident weights (everything but experts), the expert store's read buffers, the runtime
(interpreter, torch, activations), the KV pool, the expert cache in the fast tier, the host tier (discrete CUDA
only). Every tier is sized by `memory/sizing.py` `size_tiers`, the very function the engine's start-up plan calls
(engine/plan.py, from which `moeserve plan` builds its MemoryPlan): the fast tier split by `memory/split.py` from
the memory budget (`memory_gb`, or free memory less headroom), the host tier from host RAM in pinned chunks; it
refuses, one line, what cannot fit.

Speed ceilings for decode (batch 1), from bytes per token and measured bandwidths:
- fast tier: every resident weight but the embedding table (one row) plus top-k experts per MoE layer;
- worst case: additionally every expert missed, read from the slower tier;
- uniform routing: misses at the rate 1 - cache fraction (real routing is skewed, so usually better).
"""

from __future__ import annotations

from dataclasses import dataclass

from moeserve.memory.budget import GiB, HostBudget
from moeserve.memory.sizing import TierSettings, TierSizes, size_tiers
from moeserve.memory.split import MemoryNeeds, MemorySplit
from moeserve.memory.topology import MemoryTopology

# The runtime `moeserve plan` charges for the serving process's RSS at start-up (interpreter, torch, tokenizer;
# about 0.25 GiB on CPU): plan is not that process, so it states a generous figure where the engine measures its
# own. One step's activations are added to it from shapes, as the engine adds them.
RUNTIME_OVERHEAD_BYTES = GiB // 2


@dataclass(frozen=True)
class ModelFootprint:
    """Sizes of one model in the compute dtype, from its checkpoint header."""

    resident_bytes: int  # non-expert weights
    embed_bytes: int  # the embedding table (decode reads one row of it)
    hidden_bytes: int  # one row of the embedding (hidden_size x dtype)
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
    sizes: TierSizes  # the fast tier as the engine splits it, and the host tier, with the lines the engine logs

    @property
    def split(self) -> MemorySplit:
        return self.sizes.split

    @property
    def host(self) -> HostBudget:
        return self.sizes.host

    @property
    def capacity(self) -> int:  # experts in the fast tier
        return self.split.expert_capacity

    @property
    def memory_bytes(self) -> int | None:  # the total budget given, if any
        return self.split.memory_bytes

    @property
    def cache_bytes(self) -> int:
        return self.split.expert_bytes

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


def make_plan(footprint: ModelFootprint, needs: MemoryNeeds, topology: MemoryTopology, s: TierSettings) -> MemoryPlan:
    """The tiers sized by `size_tiers`, the engine's own function (ConfigError when they cannot fit)."""
    return MemoryPlan(footprint, size_tiers(needs, topology, s))


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
