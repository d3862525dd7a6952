"""The tiers below the fast one, and how a unit travels up from them into a fast-tier slot.

    fast tier (device slots, owned by ExpertStore)  <-  host tier (RAM, CUDA machines only)  <-  disk

`Loader.load(key, slot_bytes)` fills one fast-tier slot and says which tier served it:
- CPU machine: fast tier = RAM, so the unit is `pread` straight from disk into the slot (no copy at all);
- CUDA machine without a host tier: disk -> one reused staging buffer (pinned if possible) -> device slot;
- CUDA machine with a host tier: a host hit is copied from its (pinned) host slot; a host miss is read from disk
  into a host slot (evicting the least recently used one) and copied from there.
The host tier uses the host tier's own LRU: it is the victim cache of the fast tier, so recency is what matters.
"""

from __future__ import annotations

import threading
from enum import StrEnum

import torch

from moeserve.checkpoint.finite import check_expert_unit
from moeserve.experts.policies import LRUPolicy
from moeserve.experts.transfer import HostToDevice
from moeserve.experts.unit import ExpertSource
from moeserve.experts.verify import UnitVerifier, choose_checksum
from moeserve.memory.chunks import plan_chunks
from moeserve.memory.pinned import ChunkedHostPool

Key = tuple[int, int]  # (layer, expert)


class Tier(StrEnum):
    HOST = "host"
    DISK = "disk"


class HostTier:
    """A fixed pool of `capacity` units in host RAM with LRU replacement, in power-of-two chunks pinned where
    possible (memory/pinned.py: nothing for torch's pinned allocator to round up; a failure logged, the rest
    pageable)."""

    def __init__(self, capacity: int, unit_nbytes: int, copier: HostToDevice | None) -> None:
        self.capacity = capacity
        # pinned only when there is a device to copy to (a CPU fast tier under a host tier copies plainly)
        self.pool = ChunkedHostPool(plan_chunks(capacity, unit_nbytes), copier.ops.empty_pinned if copier else None)
        self._slot_of: dict[Key, int] = {}
        self._free = list(range(capacity - 1, -1, -1))
        self._lru = LRUPolicy()
        self.evictions = 0  # units dropped to make room (each one read from the disk again on its next miss)

    @property
    def nbytes(self) -> int:
        """The chunks' bytes, slack included (what the tier holds of RAM)."""
        return self.pool.nbytes

    @property
    def pinned(self) -> bool:
        """Every chunk is pinned."""
        return self.pool.all_pinned

    def is_pinned(self, t: torch.Tensor) -> bool | None:
        """Whether `t` lies in a pinned chunk of this tier (None: not in this tier)."""
        return self.pool.is_pinned(t)

    def describe(self) -> str:
        return self.pool.describe()

    def close(self) -> None:
        """Free the chunks and give the pinned RAM back (the tier is unusable after)."""
        self._slot_of.clear()
        self._free.clear()
        self.pool.close()

    def lookup(self, key: Key) -> torch.Tensor | None:
        slot = self._slot_of.get(key)
        if slot is None:
            return None
        self._lru.on_hit(key)
        return self.pool.slots[slot]

    def reserve(self, key: Key) -> torch.Tensor:
        """A host slot for `key` (evicting the LRU unit); the caller fills it, or calls `forget` on failure."""
        if self._free:
            slot = self._free.pop()
        else:
            victim = self._lru.choose_victim(())
            self._lru.on_evict(victim)
            slot = self._slot_of.pop(victim)
            self.evictions += 1
        self._slot_of[key] = slot
        self._lru.on_insert(key)
        return self.pool.slots[slot]

    def forget(self, key: Key) -> None:
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            self._lru.on_evict(key)
            self._free.append(slot)


class Loader:
    """Fills fast-tier slots from the slower tiers. Safe to call from the compute and the prefetch thread."""

    def __init__(self, source: ExpertSource, device: torch.device, copier: HostToDevice | None = None,
                 host: HostTier | None = None, verify: bool = True) -> None:
        self.source = source
        self.device = device
        self.copier = copier
        self.host = host
        # Every unit read from the disk is checked against its first read (experts/verify.py); a resident store
        # reads each unit once, so there is nothing to compare with (its load checks NaN: checkpoint/finite.py).
        self.verifier: UnitVerifier | None = UnitVerifier(
            choose_checksum(), lambda key: source.unit_files(*key),
            lambda key, unit: check_expert_unit(source, key[0], key[1], unit),
            lambda key: source.corrupt_advice(*key), padding=source.layout.padding()) if verify else None
        # Device transfers share the staging buffer / host pool: one transfer at a time (the disk is one queue
        # anyway). Direct reads into RAM slots need no lock: pread has no shared file position.
        self._lock = threading.Lock()

    @property
    def staged(self) -> bool:
        return self.host is not None or self.copier is not None

    def load(self, key: Key, slot: int, slot_bytes: torch.Tensor) -> Tier:
        """Fill `slot_bytes` (fast-tier slot `slot`) with unit `key`. Raises what the source raises."""
        layer, expert = key
        if self.verifier is not None:
            self.verifier.before_read(key)
        if not self.staged:
            self.source.read_unit(layer, expert, slot_bytes)
            if self.verifier is not None:
                self.verifier.after_read(key, slot_bytes)
            return Tier.DISK
        with self._lock:
            tier = Tier.HOST
            src = self.host.lookup(key) if self.host is not None else None
            if src is None:
                tier = Tier.DISK
                src = self.host.reserve(key) if self.host is not None else self._staging()
                if self.copier is not None:
                    self.copier.wait_source_free(src)  # an async copy may still be reading this buffer
                try:
                    self.source.read_unit(layer, expert, src)
                    if self.verifier is not None:
                        self.verifier.after_read(key, src)
                except BaseException:
                    if self.host is not None:
                        self.host.forget(key)  # the host slot holds garbage: nothing may map to it
                    raise
            self._copy_up(slot, slot_bytes, src)
            return tier

    def _staging(self) -> torch.Tensor:
        assert self.copier is not None  # staged without a host tier means a device copier exists
        return self.copier.staging

    def _copy_up(self, slot: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.copier is None:  # CPU fast tier under a host tier: a plain memory copy
            dst.copy_(src)
            return
        self.copier.copy_in(slot, dst, src, src_pinned=self._pinned(src))

    def _pinned(self, src: torch.Tensor) -> bool:
        # Pinnedness is what was recorded when each host buffer was allocated (pinning succeeded or not), never
        # guessed per call: a host-tier slot, or the staging buffer.
        assert self.copier is not None
        if self.host is not None:
            pinned = self.host.is_pinned(src)
            if pinned is not None:
                return pinned
        return self.copier.mode.asynchronous and src.data_ptr() == self.copier.staging.data_ptr()
