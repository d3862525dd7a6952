"""Every tier sized by one function, `size_tiers`: the engine at start-up and `moeserve plan` both call it, with
the same `MemoryNeeds` (from shapes) and the same `MemoryTopology` (memory/topology.py), and print its lines.

    fast tier (GPU memory, or RAM; or one unified pool): split by memory/split.py from the fast tier's free memory
    host tier (discrete CUDA only): memory/budget.py `choose_host_budget`, from host RAM, in pinned chunks
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

from moeserve.memory.budget import HostBudget, choose_host_budget
from moeserve.memory.chunks import staging_pinned_bytes
from moeserve.memory.split import MemoryNeeds, MemorySplit, split_memory
from moeserve.memory.topology import MemoryTopology


class TierSettings(Protocol):
    """The settings sizing reads (EngineSettings has them all)."""

    @property
    def memory_gb(self) -> float | None: ...
    @property
    def expert_cache_gb(self) -> float | None: ...
    @property
    def kv_cache_gb(self) -> float | None: ...
    @property
    def host_cache_gb(self) -> float | None: ...
    @property
    def max_model_len(self) -> int | None: ...
    @property
    def max_num_seqs(self) -> int: ...


@dataclass(frozen=True)
class TierSizes:
    topology: MemoryTopology
    split: MemorySplit  # the fast tier: resident, read buffers, runtime, KV pool, expert cache, context
    host: HostBudget

    @property
    def lines(self) -> tuple[tuple[str, str], ...]:
        """(name, value with its reason) in order: what the engine logs at start-up and `plan` prints."""
        return (("memory", self.topology.reason), *self.split.lines, ("host tier", self.host.reason))


def size_tiers(needs: MemoryNeeds, topology: MemoryTopology, s: TierSettings,
               max_model_len: int | None = None, context_chosen: bool = False) -> TierSizes:
    """Split the fast tier's budget and size the host tier. Raises ConfigError (one line) for what cannot fit.
    The copier's pinned staging buffers (any CUDA device) are host RAM: on a discrete GPU the host budget leaves
    them out of what it locks; on unified memory they come out of the one pool, as read buffers of the split.
    On CUDA the batched expert kernel's workspace (`MemoryNeeds.expert_workspace_bytes`) is part of the runtime.
    `max_model_len`, `context_chosen`: a context the engine chose (engine/sizing.py), over `s.max_model_len`."""
    if topology.device_type == "cuda" and topology.unified:
        needs = replace(needs, staging_bytes=needs.staging_bytes + staging_pinned_bytes(needs.unit_nbytes))
    if topology.device_type == "cuda":  # where the batched expert kernel runs: its stacked weights are runtime
        needs = replace(needs, overhead_bytes=needs.overhead_bytes + needs.expert_workspace_bytes)
    split = split_memory(needs, memory_gb=s.memory_gb, expert_cache_gb=s.expert_cache_gb, kv_cache_gb=s.kv_cache_gb,
                         max_model_len=max_model_len if context_chosen else s.max_model_len,
                         max_num_seqs=s.max_num_seqs, free_bytes=topology.fast_free_bytes,
                         context_chosen=context_chosen)
    host = choose_host_budget(s.host_cache_gb, needs.unit_nbytes, needs.total_experts, split.expert_capacity,
                              topology)
    return TierSizes(topology, split, host)
