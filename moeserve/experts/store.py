"""ExpertStore: the only owner of expert weights. The MoE layer asks it for exactly the experts it needs.

    for chunk in store.experts(layer, expert_ids):      # expert_ids ascending, unique
        for expert_id, weights in chunk:                 # weights: typed views of the unit's fields
            ...

The store keeps a pool of `capacity` slots in the fast tier, each one ExpertUnit. A needed expert that is cached
is a hit; otherwise it is read from the slower tier into a free slot (or the slot of a victim chosen by the
eviction policy). Experts of the chunk being computed are pinned: never evicted under it. When a layer needs more
experts than there are slots, they come in several chunks, in ascending expert order, so the MoE layer adds their
outputs in the same order as when everything is resident: placement never changes a bit of the result.

"Everything resident" is the case capacity >= number of experts: all units are loaded at start-up and every
access is a hit. There is no second code path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from moeserve.experts.unit import ExpertSource

Key = tuple[int, int]  # (layer, expert)
ExpertWeights = tuple[torch.Tensor, ...]  # views of one unit's fields, in layout order


@dataclass
class LayerStats:
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0


@dataclass
class StoreStats:
    """Counters since start-up; per layer and in total."""

    layers: dict[int, LayerStats] = field(default_factory=dict)
    prefetched: int = 0
    prefetch_used: int = 0

    def layer(self, layer: int) -> LayerStats:
        st = self.layers.get(layer)
        if st is None:
            st = self.layers[layer] = LayerStats()
        return st

    @property
    def hits(self) -> int:
        return sum(s.hits for s in self.layers.values())

    @property
    def misses(self) -> int:
        return sum(s.misses for s in self.layers.values())

    @property
    def bytes_read(self) -> int:
        return sum(s.bytes_read for s in self.layers.values())

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 1.0


class ExpertStore:
    """A budgeted cache of expert units in the fast tier, backed by an ExpertSource (the checkpoint on disk)."""

    def __init__(
        self,
        source: ExpertSource,
        layers: Sequence[int],
        num_experts: int,
        capacity: int,
        device: torch.device,
        policy: str = "lfru",
        progress: Callable[[int], None] | None = None,
    ) -> None:
        self.source = source
        self.layout = source.layout
        self.layers = list(layers)
        self.num_experts = num_experts
        self.total_experts = len(self.layers) * num_experts
        self.capacity = max(1, min(capacity, self.total_experts))
        self.device = device
        self.stats = StoreStats()
        # [capacity, unit_nbytes] uint8: one row per slot. Views per slot are built once (nothing per call).
        self._pool = torch.empty(self.capacity, self.layout.nbytes, dtype=torch.uint8, device=device)
        self._slot_views: list[ExpertWeights] = [self.layout.views(self._pool[s]) for s in range(self.capacity)]
        self._slot_of: dict[Key, int] = {}
        self._free_slots = list(range(self.capacity - 1, -1, -1))
        self.resident = self.capacity >= self.total_experts
        self.policy = None
        if not self.resident:
            from moeserve.experts.policies import make_policy

            self.policy = make_policy(policy)
        else:
            self._load_everything(progress)

    # ------------------------------------------------------------------------------------------- public
    @property
    def unit_nbytes(self) -> int:
        return self.layout.nbytes

    @property
    def cache_nbytes(self) -> int:
        return self.capacity * self.layout.nbytes

    def experts(self, layer: int, expert_ids: Sequence[int]) -> Iterator[list[tuple[int, ExpertWeights]]]:
        """Yield the needed experts in chunks that fit the cache, ascending by expert id.

        Each chunk's experts are pinned until the next chunk is requested (or the generator ends).
        """
        if self.resident:
            st = self.stats.layer(layer)
            st.hits += len(expert_ids)
            yield [(e, self._slot_views[self._slot_of[(layer, e)]]) for e in expert_ids]
            return
        chunk_size = self.capacity
        for start in range(0, len(expert_ids), chunk_size):
            chunk = list(expert_ids[start : start + chunk_size])
            pinned = {(layer, e) for e in chunk}
            yield [(e, self._slot_views[self._ensure((layer, e), pinned)]) for e in chunk]

    def prefetch(self, layer: int, expert_ids: Sequence[int]) -> None:
        """A hint that `layer` will soon need `expert_ids`. The resident store has nothing to do."""

    def close(self) -> None:
        self.source.checkpoint.close()

    # ------------------------------------------------------------------------------------------ internals
    def _ensure(self, key: Key, pinned: set[Key]) -> int:
        """Slot of `key`, loading it (and evicting an unpinned victim) on a miss."""
        assert self.policy is not None
        st = self.stats.layer(key[0])
        slot = self._slot_of.get(key)
        if slot is not None:
            st.hits += 1
            self.policy.on_hit(key)
            return slot
        st.misses += 1
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            victim = self.policy.choose_victim(pinned)
            slot = self._slot_of.pop(victim)
            self.policy.on_evict(victim)
        try:
            self._read(key, slot)
        except Exception:
            self._free_slots.append(slot)  # the slot holds garbage now: nothing maps to it
            raise
        self._slot_of[key] = slot
        self.policy.on_insert(key)
        st.bytes_read += self.source.stored_nbytes
        return slot

    def _read(self, key: Key, slot: int) -> None:
        if self.device.type == "cpu":
            self.source.read_unit(key[0], key[1], self._pool[slot])
        else:  # pragma: no cover - exercised on GPU machines
            staging = torch.empty(self.layout.nbytes, dtype=torch.uint8)
            self.source.read_unit(key[0], key[1], staging)
            self._pool[slot].copy_(staging)

    def _load_everything(self, progress: Callable[[int], None] | None) -> None:
        staging = None if self.device.type == "cpu" else torch.empty(self.layout.nbytes, dtype=torch.uint8)
        for layer in self.layers:
            for e in range(self.num_experts):
                slot = self._free_slots.pop()
                if staging is None:
                    self.source.read_unit(layer, e, self._pool[slot])
                else:  # pragma: no cover - exercised on GPU machines
                    self.source.read_unit(layer, e, staging)
                    self._pool[slot].copy_(staging)
                self._slot_of[(layer, e)] = slot
                if progress is not None:
                    progress(self.source.stored_nbytes)
