"""LFRU, the default eviction policy: a decayed use count per expert, aged per visit of its own layer, cycle-aware
across layers, with a fallback to per-layer recency when frequency is losing (`AdaptiveLFRUPolicy`, "lfru").
Pure Python; see docs/policies.md."""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Container

from moeserve.errors import ConfigError
from moeserve.experts.policies.base import (
    EvictionPolicy,
    Key,
    NoVictimError,
    lowest_unpinned,
    no_victim,
)

# A layer's victim candidate: (priority, push number, key, spread, skipped pinned keys, the layer's last tick).
_Candidate = tuple[float, int, Key, float, tuple[Key, ...], int]


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

    Bookkeeping (docs/policies.md "Bookkeeping cost"): per layer a heap of the cached keys, with lazy deletion,
    by log score + decay * the layer's visit count at the update (within a layer every key ages alike, so the
    order holds for good); each layer's lowest unpinned entry is kept, with the pinned keys below it and the part
    of its rank that moves only when the layer runs, until an entry goes below it, it leaves, the layer runs or a
    new layer appears: a victim costs a few operations per layer, not a heap walk and an exp. The victims are
    those of a scan of every cached key (tests/experts/test_lfru_reference.py).
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
        # Per layer (in the order their keys were first scored: the victim tie-break across layers): a min-heap of
        # (log score + decay * visit, push number, key); an entry is live while `_live[layer][key]` is its number.
        self._heap: dict[int, list[tuple[float, int, Key]]] = {}
        self._live: dict[int, dict[Key, int]] = {}
        self._pushes = 0
        # Per layer: its lowest live entry outside `skipped`, the keys of the live entries below it, pinned when it was
        # found: (priority, push number, key, its `_spread`, skipped, the layer's last tick). Dropped when an entry
        # goes below it, it leaves, the layer runs or a new layer appears; used while `skipped` are still pinned and
        # the key is not.
        self._top: dict[int, _Candidate] = {}

    def begin_layer(self, layer: int) -> None:
        self._tick += 1
        visits = self._visits.get(layer)
        if visits is None:  # n grows: every cached spread is stale
            self._visits[layer] = 1
            self._top.clear()
        else:
            self._visits[layer] = visits + 1
            self._top.pop(layer, None)
        self._last_tick[layer] = self._tick

    def _log_score_now(self, key: Key) -> float:
        log_s, visit = self._stats.get(key, (-math.inf, 0))
        return log_s - self._decay * (self._visits.get(key[0], 0) - visit)

    def _update(self, key: Key, add_use: bool) -> None:
        layer = key[0]
        visit = self._visits.get(layer, 0)
        stat = self._stats.get(key)
        log_s = -math.inf if stat is None else stat[0] - self._decay * (visit - stat[1])
        if add_use:  # s + 1, capped
            log_s = math.log1p(math.exp(log_s)) if log_s > -math.inf else 0.0
            if log_s > self._log_cap:
                log_s = self._log_cap
        self._stats[key] = (log_s, visit)
        self._pushes += 1
        live = self._live.get(layer)
        if live is None:
            live, heap = self._live[layer], self._heap[layer] = {}, []
        else:
            heap = self._heap[layer]
        live[key] = self._pushes
        priority = log_s + self._decay * visit
        heapq.heappush(heap, (priority, self._pushes, key))
        top = self._top.get(layer)
        if top is not None:
            if top[2] == key:
                del self._top[layer]
            elif priority < top[0]:  # below the candidate: it stays the lowest while `key` is pinned too
                self._top[layer] = (top[0], top[1], top[2], top[3], (*top[4], key), top[5])
        if len(heap) > 4 * len(live) + 64:  # too many stale entries: rebuild, amortised O(1)
            heap[:] = [e for e in heap if live.get(e[2]) == e[1]]
            heapq.heapify(heap)

    def _drop(self, key: Key) -> None:
        """`key` leaves the layer's heap (its score stays)."""
        live = self._live.get(key[0])
        if live is not None and live.pop(key, None) is not None:
            top = self._top.get(key[0])
            if top is not None and top[2] == key:
                del self._top[key[0]]

    def on_hit(self, key: Key) -> None:
        self._update(key, True)

    def on_insert(self, key: Key, *, prefetched: bool = False) -> None:
        self._update(key, not prefetched)

    def on_evict(self, key: Key) -> None:
        self._drop(key)
        if not self._remember:
            self._stats.pop(key, None)

    def admit(self, key: Key, victim: Key) -> bool:
        """Cache `key` only if, used now, its expected time to the next use is no longer than `victim`'s."""
        log_s = self._log_score_now(key)
        used = min(math.log1p(math.exp(log_s)) if log_s > -math.inf else 0.0, self._log_cap)  # s + 1
        return self._time_to_use(key[0], used) <= self._time_to_use(victim[0], self._log_score_now(victim))

    def on_bypass(self, key: Key) -> None:
        self._update(key, True)
        self._drop(key)  # scored as used, not cached

    def choose_victim(self, pinned: Container[Key], layers: Container[int] | None = None) -> Key:
        n, top, cycle = len(self._visits), self._top, self._cycle
        base = n - self._tick  # + a layer's last tick: calls until its next visit (d below)
        longest = 0.0  # cycle-aware: the victim's expected calls to its next use
        lowest: tuple[float, int] | None = None  # else: the victim's (spread, -last tick)
        victim: Key | None = None
        for layer, live in self._live.items():  # one candidate per layer: O(layers)
            if not live or (layers is not None and layer not in layers):
                continue
            found = top.get(layer)
            if found is None or found[2] in pinned or (found[4] and not _all_in(found[4], pinned)):
                entry = lowest_unpinned(self._heap[layer], live, pinned)  # and the pinned keys below it
                if entry is None:
                    continue
                (priority, number, key), skipped = entry
                found = top[layer] = (priority, number, key, self._spread(layer, priority, n), skipped,
                                      self._last_tick.get(layer, 0))
            if cycle:  # the longest expected calls to the next use: d until the layer runs again, + n (1/p - 1)
                d = base + found[5]
                calls = (d if d > 1 else 1) + found[3]
                if victim is None or calls > longest:  # ties: the layer first scored
                    longest, victim = calls, found[2]
            else:  # the lowest score; ties: the layer that ran last
                rank = (found[3], -found[5])
                if lowest is None or rank < lowest:
                    lowest, victim = rank, found[2]
        if victim is None:
            raise no_victim(self)
        return victim

    def _spread(self, layer: int, priority: float, n: int) -> float:
        """A heap entry's part of the victim rank that moves only with its layer's visits: n (1/p - 1) (cycle-aware)
        or the rounded log score."""
        log_now = priority - self._decay * self._visits.get(layer, 0)
        if not self._cycle:
            return round(log_now, 9)
        if log_now == -math.inf:
            return math.inf
        p = min(1.0, math.exp(log_now) * self._per_use)
        return math.inf if p == 0.0 else n * (1.0 / p - 1.0)  # p == 0: the score underflowed (~17,000 unused visits)

    def _time_to_use(self, layer: int, log_score: float) -> float:
        """Expected layer calls until a key of `layer` with this log score is used: the cycle is n layers long."""
        n = len(self._visits)
        d = max(1, n - (self._tick - self._last_tick.get(layer, 0)))  # until the layer's next visit
        if log_score == -math.inf:
            return math.inf
        p = min(1.0, math.exp(log_score) * self._per_use)
        return math.inf if p == 0.0 else d + n * (1.0 / p - 1.0)


def _all_in(keys: tuple[Key, ...], pinned: Container[Key]) -> bool:
    for key in keys:
        if key not in pinned:
            return False
    return True


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
        visits, last_tick = self._visits, self._last_tick
        for layer, order in self._order.items():
            if layers is not None and layer not in layers:
                continue
            for key in order:  # pinned keys were just used: they sit at the far end
                if key not in pinned:
                    break
            else:
                continue
            rank = (order[key] - visits.get(layer, 0), -last_tick.get(layer, 0))  # -age, then recent
            if best is None or rank < best:
                best, victim = rank, key
        if victim is None:
            raise no_victim(self)
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
        while capacity is not None and len(self.keys) >= capacity:
            try:
                victim = self.policy.choose_victim(pinned)
            except NoVictimError:  # the layer call alone fills the cache: hold one key more, as a chunk would
                break
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
    recency missed 1.1 (Belady 0.66).

    Cost: the ghosts are most of it (FLAME trace, 128 slots: 160 of the policy's ~165 us per layer call with every
    key fed to them). So, once the capacity is known, they follow only a hashed sample of the keys (SHARDS-style
    spatial sampling, Waldspurger et al., FAST 2015) at rate min(1, `ghost_keys` / capacity), each with the
    capacity scaled by that rate: both ghosts see the same sample, so their comparison stays fair. Small caches
    (capacity <= `ghost_keys`) keep every key.
    """

    name = "lfru"

    def __init__(self, half_life: float = 16.0, remember_evicted: bool = True, max_score: float | None = None,
                 adapt: bool = True, window: int = 8192, cycle_aware: bool = True, ghost_keys: int = 32) -> None:
        if window < 1:
            raise ConfigError(f"lfru: window={window} must be >= 1 (accesses)")
        if ghost_keys < 1:
            raise ConfigError(f"lfru: ghost_keys={ghost_keys} must be >= 1 (keys)")
        self._window = window
        self._ghost_keys = ghost_keys
        self._sample_below = 1 << 32  # hash threshold: every key until the capacity is known
        self._sampled: dict[Key, bool] = {}

        def scoring(cap: float | None) -> LFRUPolicy:
            return LFRUPolicy(half_life, remember_evicted, cap, cycle_aware)

        # Recency = LFRU's order capped at one use, not LRU: it ages per layer visit and breaks ties like Belady
        # (bench trace: 1.11 misses per decode step against 1.65 with LRUPolicy as the recency side).
        self._freq = scoring(max_score)  # the real cache's scorings: frequency, and recency when adapting
        self._recency = _LayerRecency() if adapt else None
        self._real: list[EvictionPolicy] = [self._freq] + ([self._recency] if self._recency is not None else [])
        self._ghosts = [_GhostCache(scoring(max_score)), _GhostCache(_LayerRecency())] if adapt else []
        self._keep = 1.0 - 1.0 / window
        self._cached = 0  # keys inserted and not evicted (loading ones included): the capacity when full
        self._capacity: int | None = None
        self._ghost_capacity: int | None = None  # the ghosts' (the sampled share of the capacity)
        self._chunk: set[Key] = set()  # this layer call's keys so far: pinned in the ghosts
        self.winner = 0  # index into _real: 0 frequency, 1 recency

    def begin_layer(self, layer: int) -> None:
        self._freq.begin_layer(layer)
        if self._recency is not None:
            self._recency.begin_layer(layer)
            for g in self._ghosts:
                g.policy.begin_layer(layer)
            self._chunk = set()

    def _in_sample(self, key: Key) -> bool:
        found = self._sampled.get(key)
        if found is None:
            h = (key[0] * 0x9E3779B1 + key[1] * 0x85EBCA77 + 0x165667B1) & 0xFFFFFFFF  # a fixed hash of the key
            h = ((h ^ (h >> 15)) * 0x2C1B3C6D) & 0xFFFFFFFF
            found = self._sampled[key] = (h ^ (h >> 13)) < self._sample_below
        return found

    def _start_sampling(self, capacity: int) -> None:
        """The capacity is known: the ghosts keep only the sampled keys, in caches scaled by the sampling rate."""
        rate = min(1.0, self._ghost_keys / capacity)
        self._sample_below = int(rate * (1 << 32))
        self._sampled.clear()
        self._keep = 1.0 - 1.0 / max(1.0, self._window * rate)  # the same window in all accesses
        self._ghost_capacity = max(1, round(capacity * rate))
        for g in self._ghosts:
            for key in [k for k in g.keys if not self._in_sample(k)]:
                g.keys.remove(key)
                g.policy.on_evict(key)

    def _demand(self, key: Key) -> None:
        """(Adapting only.) A demand access of `key`: to both ghosts when it is sampled."""
        sampled = self._sampled.get(key)
        if not (self._in_sample(key) if sampled is None else sampled):
            return
        self._chunk.add(key)
        frequency, recency = self._ghosts
        frequency.access(key, self._chunk, self._ghost_capacity, self._keep)
        recency.access(key, self._chunk, self._ghost_capacity, self._keep)
        self.winner = 0 if frequency.misses <= recency.misses else 1

    def on_hit(self, key: Key) -> None:
        self._freq.on_hit(key)
        if self._recency is not None:
            self._recency.on_hit(key)
            self._demand(key)

    def on_insert(self, key: Key, *, prefetched: bool = False) -> None:
        self._freq.on_insert(key, prefetched=prefetched)
        self._cached += 1
        if self._recency is not None:
            self._recency.on_insert(key, prefetched=prefetched)
            if not prefetched:
                self._demand(key)

    def on_evict(self, key: Key) -> None:
        self._freq.on_evict(key)
        if self._recency is not None:
            self._recency.on_evict(key)
        self._cached -= 1

    def admit(self, key: Key, victim: Key) -> bool:
        return self._real[self.winner].admit(key, victim)

    def on_bypass(self, key: Key) -> None:
        self._freq.on_bypass(key)
        if self._recency is not None:
            self._recency.on_bypass(key)
            self._demand(key)

    def choose_victim(self, pinned: Container[Key], layers: Container[int] | None = None) -> Key:
        if self._capacity is None:
            self._capacity = self._cached  # asked for a victim: the cache is full
            self._start_sampling(self._capacity)
        return self._real[self.winner].choose_victim(pinned, layers)

