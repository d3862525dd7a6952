"""The tiers below the fast one, and how a unit travels up from them into a fast-tier slot.

    fast tier (device slots, owned by ExpertStore)  <-  host tier (RAM, CUDA machines only)  <-  disk

`Loader.load(key, slot_bytes)` fills one fast-tier slot and says which tier served it:
- CPU machine: fast tier = RAM, so the unit is `pread` straight from disk into the slot (no copy at all);
- CUDA machine without a host tier: disk -> one of two staging buffers (pinned if possible) -> device slot;
- CUDA machine with a host tier: a host hit is copied from its (pinned) host slot; a host miss is read from disk
  into a host slot (evicting the least recently used one) and copied from there.
The host tier uses the host tier's own LRU: it is the victim cache of the fast tier, so recency is what matters.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Container, Iterator
from contextlib import contextmanager
from enum import StrEnum

import torch

from moeserve.checkpoint.finite import check_expert_unit
from moeserve.experts.policies import LRUPolicy, NoVictimError
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

    def reserve(self, key: Key, busy: Container[Key] = ()) -> torch.Tensor | None:
        """A host slot for `key` (evicting the LRU unit not in `busy`), or None when every unit is busy; the caller
        fills it, or calls `forget` on failure."""
        if self._free:
            slot = self._free.pop()
        else:
            try:
                victim = self._lru.choose_victim(busy)
            except NoVictimError:
                return None
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
    """Fills fast-tier slots from the slower tiers. Safe to call from several threads at once (the I/O threads,
    the compute thread, the prefetcher): no lock is held across a disk read or a copy.

    A staged load takes a source buffer under the lock (a host-tier slot, hit or reserved, marked busy so that no
    other load evicts it; else one of the copier's staging buffers, taken out of the free list), then reads and
    copies with the lock released, and gives the buffer back. With two staging buffers the read of one unit
    overlaps the copy of the previous one (which the next refill of its buffer waits for: `wait_source_free`).
    """

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
            lambda key: source.corrupt_advice(*key), padding=source.layout.padding(),
            name=lambda key: source.unit_name(*key)) if verify else None
        # Guards the host tier's map, the busy host slots and the free staging buffers; held only to take or give
        # back a buffer, never across I/O. Direct reads into RAM slots need none: pread has no shared file position.
        self._lock = threading.Lock()
        self._buffer_returned = threading.Condition(self._lock)
        # FIFO: the buffer taken next is the one given back longest ago, whose copy has had the most time to finish
        self._free_buffers: deque[torch.Tensor] = deque(copier.staging if copier is not None else ())
        self._host_busy: set[Key] = set()  # host-tier units a load is reading into or copying from
        self._spare_made = False  # see _take_buffer

    @property
    def staged(self) -> bool:
        return self.host is not None or self.copier is not None

    def load(self, key: Key, slot: int, slot_bytes: torch.Tensor) -> Tier:
        """Fill `slot_bytes` (fast-tier slot `slot`) with unit `key`. Raises what the source raises."""
        if self.verifier is not None:
            self.verifier.before_read(key)
        if not self.staged:
            self._read(key, slot_bytes)
            return Tier.DISK
        src, tier, in_host = self._filled_source(key)
        try:
            self._copy_up(slot, slot_bytes, src)
        finally:
            self._give_back(key, src, in_host, True)
        return tier

    @contextmanager
    def on_host(self, key: Key) -> Iterator[torch.Tensor]:
        """Unit `key` in host memory for the CPU to compute on where it sits (the hybrid placement,
        docs/design/gpu.md): its host-tier slot, read from the disk into it first on a host miss (kept, as a load
        keeps it), held busy (never another load's victim) until the block ends. Without a host slot for it (no
        host tier, or every slot busy) the unit passes through a staging buffer and the block gets a copy."""
        if self.verifier is not None:
            self.verifier.before_read(key)
        src, _, in_host = self._filled_source(key)
        try:
            unit = src if in_host else src.clone()  # a staging buffer goes back at once: the next load needs it
        except BaseException:
            self._give_back(key, src, in_host, True)
            raise
        if not in_host:
            self._give_back(key, src, in_host, True)
        try:
            yield unit
        finally:
            if in_host:
                self._give_back(key, src, in_host, True)

    def _filled_source(self, key: Key) -> tuple[torch.Tensor, Tier, bool]:
        """`_take_source`, with the buffer read from the disk on a host miss: (buffer holding unit `key`, the tier
        that served it, whether the buffer is a host slot). A failed read gives the buffer back and raises."""
        src, tier, in_host = self._take_source(key)
        if tier is Tier.DISK:
            try:
                if self.copier is not None:
                    self.copier.wait_source_free(src)  # an async copy may still be reading this buffer
                self._read(key, src)
            except BaseException:
                self._give_back(key, src, in_host, False)
                raise
        return src, tier, in_host

    def _read(self, key: Key, dst: torch.Tensor) -> None:
        self.source.read_unit(key[0], key[1], dst)
        if self.verifier is not None:
            self.verifier.after_read(key, dst)

    def _take_source(self, key: Key) -> tuple[torch.Tensor, Tier, bool]:
        """(the buffer `key` is copied up from, the tier that serves it, whether the buffer is a host slot)."""
        with self._lock:
            if self.host is not None and key not in self._host_busy:
                src = self.host.lookup(key)
                tier = Tier.HOST
                if src is None:
                    src, tier = self.host.reserve(key, busy=self._host_busy), Tier.DISK
                if src is not None:  # None: every host slot is busy; the unit passes through a staging buffer
                    self._host_busy.add(key)
                    return src, tier, True
            return self._take_buffer(), Tier.DISK, False

    def _take_buffer(self) -> torch.Tensor:
        """(Lock held.) A staging buffer no other load uses, waiting (asleep) for one to come back."""
        while not self._free_buffers:
            if self.copier is None and not self._spare_made:
                # CPU fast tier under a host tier with every host slot busy: one plain buffer, made on first need
                self._spare_made = True
                return torch.empty(self.source.layout.nbytes, dtype=torch.uint8)
            self._buffer_returned.wait()
        return self._free_buffers.popleft()

    def _give_back(self, key: Key, src: torch.Tensor, in_host: bool, filled: bool) -> None:
        with self._lock:
            if not in_host:
                self._free_buffers.append(src)
                self._buffer_returned.notify()
                return
            self._host_busy.discard(key)
            if not filled:
                assert self.host is not None
                self.host.forget(key)  # the host slot holds garbage: nothing may map to it

    def _copy_up(self, slot: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.copier is None:  # CPU fast tier under a host tier: a plain memory copy
            dst.copy_(src)
            return
        self.copier.copy_in(slot, dst, src, src_pinned=self._pinned(src))

    def _pinned(self, src: torch.Tensor) -> bool:
        # Pinnedness is what was recorded when each host buffer was allocated (pinning succeeded or not), never
        # guessed per call: a host-tier slot, or a staging buffer.
        assert self.copier is not None
        if self.host is not None:
            pinned = self.host.is_pinned(src)
            if pinned is not None:
                return pinned
        return self.copier.mode.asynchronous and self.copier.is_pinned_staging(src)
