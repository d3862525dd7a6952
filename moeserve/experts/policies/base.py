"""The eviction-policy interface and the structures the policies share (pure Python): `EvictionPolicy`, `Key`,
`NoVictimError`, a heap with lazy deletion (`LazyHeap`) and one per layer (`LayerHeaps`). The policies are in
experts/policies/__init__.py (registry, LRU, LFU, static, Belady) and experts/policies/lfru.py (LFRU)."""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections.abc import Container, Iterable
from typing import ClassVar

from moeserve.errors import MoeserveError

Key = tuple[int, int]  # (layer, expert)


class NoVictimError(MoeserveError):
    """Every cached expert is pinned: the caller asked for more experts at once than the cache holds."""


class EvictionPolicy(ABC):
    """Decides which cached expert leaves when the cache is full. Sees only keys, never weights."""

    name: ClassVar[str]

    def begin_layer(self, layer: int) -> None:  # noqa: B027 - an optional hook, a no-op by default
        """Called once per acquire (per chunk) of ``layer``, before that call's hits and inserts.

        It is the policy's logical clock: LFRU ages a layer's experts per visit of that layer, Belady steps
        through its known future. Policies that need no clock ignore it.
        """

    @abstractmethod
    def on_hit(self, key: Key) -> None:
        """``key`` was needed and was already cached."""

    @abstractmethod
    def on_insert(self, key: Key, *, prefetched: bool = False) -> None:
        """``key`` was loaded into the cache: after a miss (it is being used now) or, with ``prefetched``,
        ahead of a predicted use (not a use yet; a later `on_hit` counts the use)."""

    @abstractmethod
    def on_evict(self, key: Key) -> None:
        """``key`` left the cache (normally the key `choose_victim` just returned)."""

    def admit(self, key: Key, victim: Key) -> bool:
        """Admission control: whether the demand miss `key` should be cached at the price of evicting `victim`
        (False: serve it from the read buffer and keep `victim`). Default: always. Asked by the store with
        expert_admission=policy and by `simulate(..., admission=True)` (SlotCache.admits)."""
        return True

    def on_bypass(self, key: Key) -> None:  # noqa: B027 - an optional hook, a no-op by default
        """`key` was needed, missed and served without being cached (after `admit` said no): a use, no insert."""

    @abstractmethod
    def choose_victim(self, pinned: Container[Key], layers: Container[int] | None = None) -> Key:
        """A cached key not in ``pinned``, to evict next. Does not evict it (the caller calls `on_evict`).

        ``layers``: the victim's layer must be one of these (None: any layer). The cache's capacity mode uses it
        (experts/quota.py): with per-layer quotas a full layer evicts one of its own keys.
        Raises `NoVictimError` when every allowed cached key is pinned.
        """


def no_victim(policy: EvictionPolicy) -> NoVictimError:
    return NoVictimError(
        f"{policy.name}: every cached expert is pinned; the cache is smaller than one layer call"
    )


def first_unpinned(order: Iterable[Key], pinned: Container[Key], layers: Container[int] | None = None) -> Key | None:
    # Pinned keys were just used, so in recency order they sit at the far end: this stops early. A layer
    # restriction (per-layer quotas) skips other layers' keys; the layer about to run holds the oldest keys.
    for key in order:
        if key not in pinned and (layers is None or key[0] in layers):
            return key
    return None



class LazyHeap:
    """A min-heap of keys with changeable priorities: stale entries are skipped when they reach the top."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Key]] = []
        self._live: dict[Key, int] = {}  # key -> sequence number of its valid entry
        self._seq = 0

    def __len__(self) -> int:
        return len(self._live)

    def push(self, key: Key, priority: float, seq: int | None = None) -> None:
        """`seq`: the tie-break among equal priorities (default: this heap's own insertion order)."""
        if seq is None:
            self._seq += 1
            seq = self._seq
        self._live[key] = seq
        heapq.heappush(self._heap, (priority, seq, key))
        if len(self._heap) > 4 * len(self._live) + 64:  # too many stale entries: rebuild, amortised O(1)
            self._heap = [e for e in self._heap if self._live.get(e[2]) == e[1]]
            heapq.heapify(self._heap)

    def remove(self, key: Key) -> None:
        self._live.pop(key, None)

    def seq(self, key: Key) -> int:
        return self._live[key]

    def min_unpinned(self, pinned: Container[Key]) -> tuple[float, Key] | None:
        """The lowest-priority key not in ``pinned`` (the heap is unchanged apart from dropping stale entries)."""
        found = lowest_unpinned(self._heap, self._live, pinned)
        return None if found is None else (found[0][0], found[0][2])


def lowest_unpinned(heap: list[tuple[float, int, Key]], live: dict[Key, int], pinned: Container[Key]
                    ) -> tuple[tuple[float, int, Key], tuple[Key, ...]] | None:
    """A lazy heap's lowest live entry (priority, number, key) whose key is not in `pinned`, and the (pinned) keys of
    the live entries below it; None when every live key is pinned. An entry is live while `live[key]` is its number;
    stale entries met on the way are dropped, live ones stay."""
    set_aside: list[tuple[float, int, Key]] = []
    found = None
    while heap:
        entry = heap[0]
        if live.get(entry[2]) != entry[1]:
            heapq.heappop(heap)
        elif entry[2] in pinned:
            set_aside.append(heapq.heappop(heap))
        else:
            found = (entry, tuple(e[2] for e in set_aside))
            break
    for e in set_aside:
        heapq.heappush(heap, e)
    return found


class LayerHeaps:
    """One `LazyHeap` per layer with priorities comparable across layers: the minimum over the allowed layers is
    the global minimum (ties by insertion order, as one global heap), and a layer restriction costs nothing."""

    def __init__(self) -> None:
        self._heaps: dict[int, LazyHeap] = {}
        self._seq = 0

    def push(self, key: Key, priority: float) -> None:
        self._seq += 1
        heap = self._heaps.get(key[0])
        if heap is None:
            heap = self._heaps[key[0]] = LazyHeap()
        heap.push(key, priority, self._seq)

    def remove(self, key: Key) -> None:
        heap = self._heaps.get(key[0])
        if heap is not None:
            heap.remove(key)

    def min_unpinned(self, pinned: Container[Key], layers: Container[int] | None) -> Key | None:
        best: tuple[float, int] | None = None
        victim: Key | None = None
        for layer, heap in self._heaps.items():
            if not len(heap) or (layers is not None and layer not in layers):
                continue
            found = heap.min_unpinned(pinned)
            if found is not None and (best is None or (found[0], heap.seq(found[1])) < best):
                best, victim = (found[0], heap.seq(found[1])), found[1]
        return victim

