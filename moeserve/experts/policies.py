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
"""

from __future__ import annotations

import difflib
import heapq
import math
from abc import ABC, abstractmethod
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Container, Iterable, Mapping, Sequence
from typing import Any, ClassVar

from moeserve.errors import ConfigError, MoeserveError

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

    @abstractmethod
    def choose_victim(self, pinned: Container[Key], layers: Container[int] | None = None) -> Key:
        """A cached key not in ``pinned``, to evict next. Does not evict it (the caller calls `on_evict`).

        ``layers``: the victim's layer must be one of these (None: any layer). The cache's capacity mode uses it
        (experts/quota.py): with per-layer quotas a full layer evicts one of its own keys.
        Raises `NoVictimError` when every allowed cached key is pinned.
        """


def _no_victim(policy: EvictionPolicy) -> NoVictimError:
    return NoVictimError(
        f"{policy.name}: every cached expert is pinned; the cache is smaller than one layer call"
    )


def _first_unpinned(order: Iterable[Key], pinned: Container[Key], layers: Container[int] | None = None) -> Key | None:
    # Pinned keys were just used, so in recency order they sit at the far end: this stops early. A layer
    # restriction (per-layer quotas) skips other layers' keys; the layer about to run holds the oldest keys.
    for key in order:
        if key not in pinned and (layers is None or key[0] in layers):
            return key
    return None


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
        victim = _first_unpinned(self._order, pinned, layers)
        if victim is None:
            raise _no_victim(self)
        return victim


class _LazyHeap:
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
        heap, live = self._heap, self._live
        set_aside: list[tuple[float, int, Key]] = []
        found: tuple[float, Key] | None = None
        while heap:
            prio, seq, key = heap[0]
            if live.get(key) != seq:
                heapq.heappop(heap)
            elif key in pinned:
                set_aside.append(heapq.heappop(heap))
            else:
                found = (prio, key)
                break
        for entry in set_aside:
            heapq.heappush(heap, entry)
        return found


class _LayerHeaps:
    """One `_LazyHeap` per layer with priorities comparable across layers: the minimum over the allowed layers is
    the global minimum (ties by insertion order, as one global heap), and a layer restriction costs nothing."""

    def __init__(self) -> None:
        self._heaps: dict[int, _LazyHeap] = {}
        self._seq = 0

    def push(self, key: Key, priority: float) -> None:
        self._seq += 1
        heap = self._heaps.get(key[0])
        if heap is None:
            heap = self._heaps[key[0]] = _LazyHeap()
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
        self._heap = _LayerHeaps()
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
            raise _no_victim(self)
        return found


class LFRUPolicy(EvictionPolicy):
    """Frequency-weighted recency, aged per visit of the key's own layer (the default policy).

    Each expert (cached or not: there are only layers x experts of them) has a score
    ``s = sum over its past uses of 2 ** (-(visits of its layer since that use) / half_life)``: an
    exponentially decayed use count, i.e. an estimate of how likely the expert is to be used the next time
    its layer runs. The victim is the cached, unpinned key with the lowest score; among equal scores, the key
    whose layer ran most recently (its next chance of a hit is furthest away, as Belady would choose).

    Age is counted in visits of the key's OWN layer, not in global time. With a global clock, keys of the
    layer about to run look oldest (their last use was one full forward ago) and are evicted just before
    they are needed, while keys of the layers that just ran look fresh: the layers early in the last forward
    would crowd out the others. Per-layer ageing gives every layer the same footing: a key's score depends
    only on how often its layer needed it.
    """

    name = "lfru"

    def __init__(self, half_life: float = 16.0, remember_evicted: bool = True, max_score: float | None = None,
                 cycle_aware: bool = False) -> None:
        """`max_score`: a use count the score never exceeds (None: no cap). 1 makes the policy pure recency, aged
        per visit of the key's layer (with the tie-break above: Belady's choice among equally old keys).
        `cycle_aware`: across layers, evict the key with the longest expected time to its next use, d + n (1/p - 1)
        layer calls: d until its layer's next visit (layers run in a cycle of n), p its chance of use per visit
        (the score times 1 - 2^(-1/half_life)). Within a layer the order is the same as without."""
        if half_life <= 0:
            raise ConfigError(f"lfru: half_life={half_life} must be > 0 (layer visits)")
        if max_score is not None and max_score < 1:
            raise ConfigError(f"lfru: max_score={max_score} must be >= 1 (one use)")
        self._decay = math.log(2.0) / half_life  # log-score lost per visit of the key's layer
        self._cycle = cycle_aware
        self._per_use = 1.0 - 2.0 ** (-1.0 / half_life)  # score -> chance per visit, in the steady state
        self._log_cap = math.inf if max_score is None else math.log(max_score)
        self._remember = remember_evicted
        self._visits: dict[int, int] = {}  # layer -> visits so far
        self._last_tick: dict[int, int] = {}  # layer -> global tick of its latest visit (tie-break)
        self._tick = 0
        # Per key: (log score, visit count of its layer when that log score was exact).
        self._stats: dict[Key, tuple[float, int]] = {}
        self._heaps: dict[int, _LazyHeap] = {}  # per layer; priority = log score + decay * visit

    def begin_layer(self, layer: int) -> None:
        self._tick += 1
        self._visits[layer] = self._visits.get(layer, 0) + 1
        self._last_tick[layer] = self._tick

    def _log_score_now(self, key: Key) -> float:
        log_s, visit = self._stats.get(key, (-math.inf, 0))
        return log_s - self._decay * (self._visits.get(key[0], 0) - visit)

    def _update(self, key: Key, add_use: bool) -> None:
        layer = key[0]
        visit = self._visits.get(layer, 0)
        log_s = self._log_score_now(key)
        if add_use:
            log_s = min(math.log1p(math.exp(log_s)) if log_s > -math.inf else 0.0, self._log_cap)  # s + 1
        self._stats[key] = (log_s, visit)
        # Within one layer every key ages at the same rate, so this priority orders them for good.
        self._heaps.setdefault(layer, _LazyHeap()).push(key, log_s + self._decay * visit)

    def on_hit(self, key: Key) -> None:
        self._update(key, add_use=True)

    def on_insert(self, key: Key, *, prefetched: bool = False) -> None:
        self._update(key, add_use=not prefetched)

    def on_evict(self, key: Key) -> None:
        heap = self._heaps.get(key[0])
        if heap is not None:
            heap.remove(key)
        if not self._remember:
            self._stats.pop(key, None)

    def choose_victim(self, pinned: Container[Key], layers: Container[int] | None = None) -> Key:
        best: tuple[float, int] | None = None
        victim: Key | None = None
        for layer, heap in self._heaps.items():  # one candidate per layer: O(layers * log n)
            if not len(heap) or (layers is not None and layer not in layers):
                continue
            found = heap.min_unpinned(pinned)
            if found is None:
                continue
            log_now = found[0] - self._decay * self._visits.get(layer, 0)
            rank = ((-self._time_to_use(layer, log_now), 0) if self._cycle else
                    (round(log_now, 9), -self._last_tick.get(layer, 0)))
            if best is None or rank < best:
                best, victim = rank, found[1]
        if victim is None:
            raise _no_victim(self)
        return victim


    def _time_to_use(self, layer: int, log_score: float) -> float:
        """Expected layer calls until a key of `layer` with this log score is used: the cycle is n layers long."""
        n = len(self._visits)
        d = max(1, n - (self._tick - self._last_tick.get(layer, 0)))  # until the layer's next visit
        if log_score == -math.inf:
            return math.inf
        p = min(1.0, math.exp(log_score) * self._per_use)
        return d + n * (1.0 / p - 1.0)


class _LayerRecency(EvictionPolicy):
    """Recency aged per visit of the key's own layer: LFRUPolicy(max_score=1)'s order at a fraction of its cost
    (an OrderedDict per layer instead of scores and heaps). The victim is the unpinned key whose layer ran most
    often since the key was last used; among equals, the key whose layer ran most recently (Belady's choice). A
    key prefetched and not used yet goes first (LFRU keeps such a key's old score when it had one)."""

    name = "lfru-recency"

    def __init__(self) -> None:
        self._order: dict[int, OrderedDict[Key, float]] = {}  # layer -> key -> visit of its last use, oldest first
        self._visits: dict[int, int] = {}
        self._last_tick: dict[int, int] = {}
        self._tick = 0

    def begin_layer(self, layer: int) -> None:
        self._tick += 1
        self._visits[layer] = self._visits.get(layer, 0) + 1
        self._last_tick[layer] = self._tick

    def on_hit(self, key: Key) -> None:
        order = self._order.get(key[0])
        if order is None:
            order = self._order[key[0]] = OrderedDict()
        order[key] = self._visits.get(key[0], 0)
        order.move_to_end(key)

    def on_insert(self, key: Key, *, prefetched: bool = False) -> None:
        if not prefetched:
            self.on_hit(key)
            return
        order = self._order.setdefault(key[0], OrderedDict())
        order[key] = -math.inf  # never used: older than anything
        order.move_to_end(key, last=False)

    def on_evict(self, key: Key) -> None:
        order = self._order.get(key[0])
        if order is not None:
            order.pop(key, None)

    def choose_victim(self, pinned: Container[Key], layers: Container[int] | None = None) -> Key:
        best: tuple[float, int] | None = None
        victim: Key | None = None
        for layer, order in self._order.items():
            if layers is not None and layer not in layers:
                continue
            key = _first_unpinned(order, pinned)
            if key is None:
                continue
            rank = (order[key] - self._visits.get(layer, 0), -self._last_tick.get(layer, 0))  # -age, then recent
            if best is None or rank < best:
                best, victim = rank, key
        if victim is None:
            raise _no_victim(self)
        return victim


class _GhostCache:
    """Keys only: what a cache of the real one's capacity would hold under `policy`, fed the same demand accesses.
    Its `misses` (decayed per access) say how that policy would have done lately."""

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self.keys: set[Key] = set()
        self.misses = 0.0

    def access(self, key: Key, pinned: Container[Key], capacity: int | None, keep: float) -> None:
        self.misses *= keep
        if key in self.keys:
            self.policy.on_hit(key)
            return
        self.misses += 1.0
        if capacity is not None and len(self.keys) >= capacity:
            try:
                victim = self.policy.choose_victim(pinned)
            except NoVictimError:  # the layer call alone fills the cache: hold one key more, as a chunk would
                victim = None
            if victim is not None:
                self.keys.remove(victim)
                self.policy.on_evict(victim)
        self.keys.add(key)
        self.policy.on_insert(key)


class AdaptiveLFRUPolicy(EvictionPolicy):
    """LFRU that falls back to recency when frequency is losing (the default policy, "lfru").

    Two scorings of the same keys: LFRU's decayed use count (`LFRUPolicy`, frequency) and the same with the score
    capped at one use (recency aged per layer visit). Each also runs on a ghost cache of the real capacity (keys
    only, learnt at the first eviction) fed the same demand accesses; victims come from the scoring whose ghost
    missed less over about the last `window` accesses (frequency on ties, so it starts as plain LFRU).

    Why: frequency wins where the popular experts stay popular (FLAME-MoE trace: LFRU 0.297 vs LRU 0.217 at 128
    experts), but loses badly when the working set moves, e.g. a new prompt after a decode that kept reusing a
    few experts: stale counts then keep the old set for ~16 * log2(count) visits of each layer. On the large
    bench model (prefill 32 + decode 32 per prompt, cache of 341) LFRU missed 4.1 experts per decode step where
    recency missed 1.1 (Belady 0.66). Cost: every access updates four scorings instead of one (pure Python).
    """

    name = "lfru"

    def __init__(self, half_life: float = 16.0, remember_evicted: bool = True, max_score: float | None = None,
                 adapt: bool = True, window: int = 8192, cycle_aware: bool = True) -> None:
        if window < 1:
            raise ConfigError(f"lfru: window={window} must be >= 1 (accesses)")

        def scoring(cap: float | None) -> LFRUPolicy:
            return LFRUPolicy(half_life, remember_evicted, cap, cycle_aware)

        # Recency = LFRU's order capped at one use, not LRU: it ages per layer visit and breaks ties like Belady
        # (bench trace: 1.11 misses per decode step against 1.65 with LRUPolicy as the recency side).
        self._real: list[EvictionPolicy] = [scoring(max_score)] + ([_LayerRecency()] if adapt else [])  # real cache
        self._ghosts = [_GhostCache(scoring(max_score)), _GhostCache(_LayerRecency())] if adapt else []
        self._keep = 1.0 - 1.0 / window
        self._cached = 0  # keys inserted and not evicted (loading ones included): the capacity when full
        self._capacity: int | None = None
        self._chunk: set[Key] = set()  # this layer call's keys so far: pinned in the ghosts
        self.winner = 0  # index into _real: 0 frequency, 1 recency

    def begin_layer(self, layer: int) -> None:
        for p in self._real:
            p.begin_layer(layer)
        for g in self._ghosts:
            g.policy.begin_layer(layer)
        self._chunk = set()

    def _demand(self, key: Key) -> None:
        if not self._ghosts:
            return
        self._chunk.add(key)
        for g in self._ghosts:
            g.access(key, self._chunk, self._capacity, self._keep)
        self.winner = 0 if self._ghosts[0].misses <= self._ghosts[1].misses else 1

    def on_hit(self, key: Key) -> None:
        for p in self._real:
            p.on_hit(key)
        self._demand(key)

    def on_insert(self, key: Key, *, prefetched: bool = False) -> None:
        for p in self._real:
            p.on_insert(key, prefetched=prefetched)
        self._cached += 1
        if not prefetched:
            self._demand(key)

    def on_evict(self, key: Key) -> None:
        for p in self._real:
            p.on_evict(key)
        self._cached -= 1

    def choose_victim(self, pinned: Container[Key], layers: Container[int] | None = None) -> Key:
        if self._capacity is None:
            self._capacity = self._cached  # asked for a victim: the cache is full
        return self._real[self.winner].choose_victim(pinned, layers)


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
        raise _no_victim(self)


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
        self._heap = _LayerHeaps()  # priority = -(index of next use): the furthest next use on top

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
            raise _no_victim(self)
        return found


_REGISTRY: dict[str, type[EvictionPolicy]] = {
    cls.name: cls for cls in (LRUPolicy, LFUPolicy, AdaptiveLFRUPolicy, StaticPolicy, BeladyPolicy)
}
POLICY_NAMES: tuple[str, ...] = tuple(_REGISTRY)
ONLINE_POLICY_NAMES: tuple[str, ...] = ("lru", "lfu", "lfru", "static")  # usable by the engine
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
