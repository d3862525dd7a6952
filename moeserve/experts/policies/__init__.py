"""Eviction policies for the expert cache: pure Python, no torch, no numpy.

The cache is one pool of slots over all MoE layers (shared among them as its capacity mode says, experts/quota.py:
a quota restricts `choose_victim` to some layers); a key is ``(layer, expert)``. `SlotCache`
(experts/slot_cache.py, which both the expert store and the simulator in `moeserve.bench.simulate` drive) calls a
policy like this, once per layer call (once per chunk when a layer needs more experts than the cache holds)::

    policy.begin_layer(layer)
    for key in needed keys already cached:  policy.on_hit(key)          # these are pinned first
    for key in needed keys not cached:
        if cache is full: victim = policy.choose_victim(pinned); evict it; policy.on_evict(victim)
        load key; policy.on_insert(key)
    (optional prefetch for the next layer: evict as above, never a pinned or predicted key, load,
     policy.on_insert(key, prefetched=True))

Every operation is O(1) or O(log n) amortised (OrderedDict, heaps with lazy deletion); LFRU's
`choose_victim` also looks at one candidate per MoE layer (O(layers), never O(cache)). See docs/policies.md.

This module holds the registry (`make_policy`), LRU, LFU, static, Belady and `DeferredHits`; the interface and shared
heaps are in experts/policies/base.py, the LFRU family in experts/policies/lfru.py (all re-exported here).
"""

from __future__ import annotations

import difflib
import math
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Container, Iterable, Mapping, Sequence
from typing import Any

from moeserve.errors import ConfigError
from moeserve.experts.policies.base import (
    EvictionPolicy,
    Key,
    LayerHeaps,
    NoVictimError,
    first_unpinned,
    no_victim,
)
from moeserve.experts.policies.lfru import AdaptiveLFRUPolicy, LFRUPolicy, _LayerRecency
from moeserve.experts.policies.reuse import ReusePolicy

__all__ = [
    "DEFAULT_POLICY", "ONLINE_POLICY_NAMES", "POLICY_NAMES", "AdaptiveLFRUPolicy", "BeladyPolicy", "DeferredHits",
    "EvictionPolicy", "Key", "LFRUPolicy", "LFUPolicy", "LRUPolicy", "NoVictimError", "ReusePolicy", "StaticPolicy", "_LayerRecency",
    "make_policy",
]


class LRUPolicy(EvictionPolicy):
    """Least recently used: evicts the key whose last use (or load) is oldest."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()  # oldest first

    def on_hit(self, key: Key) -> None:
        self._order.move_to_end(key)

    def on_insert(self, key: Key, *, prefetched: bool = False) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_evict(self, key: Key) -> None:
        self._order.pop(key, None)

    def choose_victim(self, pinned: Container[Key], layers: Container[int] | None = None) -> Key:
        victim = first_unpinned(self._order, pinned, layers)
        if victim is None:
            raise no_victim(self)
        return victim



class LFUPolicy(EvictionPolicy):
    """Least frequently used with dynamic ageing (LFU-DA).

    Each cached key has priority ``age + uses`` where ``uses`` counts uses since it was loaded and ``age`` is
    the cache's age when the key was last touched. Evicting a key raises the cache's age to that key's
    priority. So a key that was popular long ago but is no longer used is overtaken by newcomers once the
    age has grown past its old count: frequency ages without ever rescanning the cache.
    """

    name = "lfu"

    def __init__(self) -> None:
        self._uses: dict[Key, int] = {}
        self._prio: dict[Key, float] = {}
        self._heap = LayerHeaps()
        self._age = 0.0

    def _touch(self, key: Key, uses: int) -> None:
        self._uses[key] = uses
        self._prio[key] = self._age + uses
        self._heap.push(key, self._prio[key])

    def on_hit(self, key: Key) -> None:
        self._touch(key, self._uses.get(key, 0) + 1)

    def on_insert(self, key: Key, *, prefetched: bool = False) -> None:
        self._touch(key, 0 if prefetched else 1)

    def on_evict(self, key: Key) -> None:
        prio = self._prio.pop(key, None)
        if prio is not None:
            self._age = max(self._age, prio)
        self._uses.pop(key, None)
        self._heap.remove(key)

    def choose_victim(self, pinned: Container[Key], layers: Container[int] | None = None) -> Key:
        found = self._heap.min_unpinned(pinned, layers)
        if found is None:
            raise no_victim(self)
        return found



class StaticPolicy(EvictionPolicy):
    """Keeps the ``num_pinned`` most frequent experts of a recorded trace; the other slots are LRU.

    ``counts`` maps ``(layer, expert)`` to how often it was used (e.g. layer calls that needed it) in a
    trace recorded earlier. Pinned-by-profile keys are loaded on first use like any other and then only
    evicted when no other cached key is evictable.
    """

    name = "static"

    def __init__(self, counts: Mapping[Key, float], num_pinned: int) -> None:
        if num_pinned < 0:
            raise ConfigError(f"static: num_pinned={num_pinned} must be >= 0")
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        self.static_keys: frozenset[Key] = frozenset(k for k, c in ranked[:num_pinned] if c > 0)
        self._dynamic = LRUPolicy()
        self._static = LRUPolicy()  # fallback order among cached static keys

    def _part(self, key: Key) -> LRUPolicy:
        return self._static if key in self.static_keys else self._dynamic

    def on_hit(self, key: Key) -> None:
        self._part(key).on_hit(key)

    def on_insert(self, key: Key, *, prefetched: bool = False) -> None:
        self._part(key).on_insert(key, prefetched=prefetched)

    def on_evict(self, key: Key) -> None:
        self._part(key).on_evict(key)

    def choose_victim(self, pinned: Container[Key], layers: Container[int] | None = None) -> Key:
        for part in (self._dynamic, self._static):
            try:
                return part.choose_victim(pinned, layers)
            except NoVictimError:
                pass
        raise no_victim(self)


class BeladyPolicy(EvictionPolicy):
    """Belady's MIN, the offline optimum for demand loading: evicts the key needed furthest in the future.

    Simulator only: ``future`` is the whole sequence of acquire calls, one collection of keys per
    `begin_layer` call, in the order they will happen (after chunking).
    """

    name = "belady"

    def __init__(self, future: Sequence[Iterable[Key]]) -> None:
        self._uses: dict[Key, list[int]] = {}  # key -> ascending indices of the calls that need it
        for index, keys in enumerate(future):
            for key in keys:
                self._uses.setdefault(key, []).append(index)
        self._now = -1
        self._heap = LayerHeaps()  # priority = -(index of next use): the furthest next use on top

    def begin_layer(self, layer: int) -> None:
        self._now += 1

    def _touch(self, key: Key) -> None:
        uses = self._uses.get(key, [])
        pos = bisect_right(uses, self._now)
        next_use = uses[pos] if pos < len(uses) else math.inf
        self._heap.push(key, -next_use)

    def on_hit(self, key: Key) -> None:
        self._touch(key)

    def on_insert(self, key: Key, *, prefetched: bool = False) -> None:
        self._touch(key)

    def on_evict(self, key: Key) -> None:
        self._heap.remove(key)

    def choose_victim(self, pinned: Container[Key], layers: Container[int] | None = None) -> Key:
        found = self._heap.min_unpinned(pinned, layers)
        if found is None:
            raise no_victim(self)
        return found


_REGISTRY: dict[str, type[EvictionPolicy]] = {
    cls.name: cls for cls in (LRUPolicy, LFUPolicy, AdaptiveLFRUPolicy, ReusePolicy, StaticPolicy, BeladyPolicy)
}
POLICY_NAMES: tuple[str, ...] = tuple(_REGISTRY)
ONLINE_POLICY_NAMES: tuple[str, ...] = ("lru", "lfu", "lfru", "reuse", "static")  # usable by the engine
DEFAULT_POLICY = "lfru"


class DeferredHits(EvictionPolicy):
    """Another policy, told of layer visits and hits in batches: `begin_layer` and `on_hit` are logged and replayed,
    in order, right before any other call (or once `max_pending` are logged). The wrapped policy sees exactly the
    same calls in the same order, so it makes exactly the same choices; only WHEN its bookkeeping runs changes.

    Why: the store asks the policy once per MoE layer, between two layers' expert compute, which streams tens of MB
    of weights through the CPU caches; the policy's dicts and heaps (and the interpreter's own data) are cold every
    time. One store.experts call with four hits took 18 us with warm caches and 66 us with the caches flushed
    between calls (large bench model, adaptive LFRU): ~1.6 ms of a 22 ms decode step. Replayed in batches, most
    of that work finds its data in the caches. Misses replay the log first (the victim choice needs it), so a
    decode step of hits only pays for its bookkeeping once per `max_pending` events.
    """

    def __init__(self, policy: EvictionPolicy, max_pending: int = 512) -> None:
        self.inner = policy
        self.name = policy.name  # type: ignore[misc]  # the wrapped policy's name, per instance
        self._log: list[tuple[bool, Any]] = []  # (is_hit, key) or (False, layer)
        self._max = max_pending

    def flush(self) -> None:
        """Replay the logged visits and hits into the wrapped policy."""
        log, inner = self._log, self.inner
        if not log:  # most calls after the first miss of a layer call: nothing new
            return
        for is_hit, item in log:
            if is_hit:
                inner.on_hit(item)
            else:
                inner.begin_layer(item)
        log.clear()

    def begin_layer(self, layer: int) -> None:
        self._log.append((False, layer))
        if len(self._log) >= self._max:
            self.flush()

    def on_hit(self, key: Key) -> None:
        self._log.append((True, key))
        if len(self._log) >= self._max:
            self.flush()

    def on_insert(self, key: Key, *, prefetched: bool = False) -> None:
        self.flush()
        self.inner.on_insert(key, prefetched=prefetched)

    def on_evict(self, key: Key) -> None:
        self.flush()
        self.inner.on_evict(key)

    def choose_victim(self, pinned: Container[Key], layers: Container[int] | None = None) -> Key:
        self.flush()
        return self.inner.choose_victim(pinned, layers)

    def admit(self, key: Key, victim: Key) -> bool:
        self.flush()
        return self.inner.admit(key, victim)

    def on_bypass(self, key: Key) -> None:
        self.flush()
        self.inner.on_bypass(key)


def make_policy(name: str, **options: Any) -> EvictionPolicy:
    """Build a policy by name. ``static`` needs ``counts`` and ``num_pinned``; ``belady`` needs ``future``."""
    cls = _REGISTRY.get(name)
    if cls is None:
        close = difflib.get_close_matches(name, POLICY_NAMES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f"; choose one of {', '.join(POLICY_NAMES)}"
        raise ConfigError(f"unknown eviction policy {name!r}{hint}")
    try:
        return cls(**options)
    except TypeError as err:
        raise ConfigError(f"eviction policy {name!r}: bad options {sorted(options)} ({err})") from err
