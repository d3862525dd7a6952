"""SlotCache: which expert unit sits in which fast-tier slot, and everything the eviction policy hears.

Pure Python: no torch, no threads, no I/O. The expert store wraps it in a lock and moves the bytes; the cache
simulator (`moeserve.bench.simulate`) replays traces through the very same class, so the two cannot drift.

A slot is in exactly one state: free, loading (taken for a key whose bytes are being written; no key maps to it
yet) or ready (in the map). One layer call of the store, per chunk of at most `capacity` experts::

    cache.pin(keys)                          # the chunk's keys: never a victim while it is in use
    (the store waits here while any of `keys` is loading)
    misses = cache.begin_call(layer, keys)   # policy.begin_layer; hits counted and told (on_hit); protection ends
    for key in misses:                       # ascending, as given
        slot = cache.take_miss_slot(key)     # free slot or a victim's; policy.on_insert; counted as a miss
        ... read the unit into slot ...; cache.finish_read(key)   (or cache.abandon_read(key) on failure)
    (optional prefetch for the next layer, see below)
    cache.release(keys)

Prefetch: `protect` the guessing layer's keys, then `plan_prefetch(predicted keys)` protects the predicted keys
already cached (or loading) and returns the others, which are read into slots from `take_prefetch_slot` until it
says there is no room. A prefetch victim is never pinned, loading or protected: loading one guess cannot evict
another guess, nor an expert the predicted layer needs that happens to be cached. Protection lasts until the next
layer call begins (that is the call it was for) or the store drops the request (`end_protection`).

Capacity modes (`quota`, experts/quota.py): shared (one pool), per_layer (a quota per layer: a full layer evicts its
own) or mixed (a floor per layer, the rest shared). Every read, demand or prefetch, obeys it; a layer call is chunked
at `chunk_limit(layer)` so that one chunk always fits.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from moeserve.errors import MoeserveError
from moeserve.experts.policies import EvictionPolicy, Key, NoVictimError
from moeserve.experts.quota import CacheQuota, make_quota


@dataclass
class LayerStats:
    hits: int = 0
    misses: int = 0
    bytes_from_disk: int = 0
    bytes_from_host: int = 0
    prefetched: int = 0  # units loaded ahead of a predicted use (their bytes are in bytes_from_*)
    prefetch_used: int = 0  # prefetched units that were needed before being evicted
    # Demand misses on units a prefetch evicted, at the next call of their layer: what prefetch cost in hits.
    prefetch_harm: int = 0
    bypassed: int = 0  # misses served from a bypass buffer, not cached (admission control; counted in misses)

    @property
    def bytes_read(self) -> int:
        return self.bytes_from_disk + self.bytes_from_host


@dataclass
class StoreStats:
    """Counters since start-up; per layer and in total. Hits and misses count needed experts per layer call."""

    layers: dict[int, LayerStats] = field(default_factory=dict)
    load_errors: int = 0
    # Seconds the compute thread was blocked on expert reads (misses, and prefetches it needed in flight), and
    # seconds spent reading misses on any thread: where an offloaded token's time goes.
    wait_seconds: float = 0.0
    read_seconds: float = 0.0

    def layer(self, layer: int) -> LayerStats:
        st = self.layers.get(layer)
        if st is None:
            st = self.layers[layer] = LayerStats()
        return st

    def _total(self, name: str) -> int:
        return sum(getattr(s, name) for s in self.layers.values())

    hits = property(lambda self: self._total("hits"))
    misses = property(lambda self: self._total("misses"))
    bytes_from_disk = property(lambda self: self._total("bytes_from_disk"))
    bytes_from_host = property(lambda self: self._total("bytes_from_host"))
    bytes_read = property(lambda self: self._total("bytes_read"))
    prefetched = property(lambda self: self._total("prefetched"))
    prefetch_used = property(lambda self: self._total("prefetch_used"))
    prefetch_harm = property(lambda self: self._total("prefetch_harm"))
    bypassed = property(lambda self: self._total("bypassed"))

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 1.0

    @property
    def prefetch_accuracy(self) -> float | None:
        """Share of prefetched units that were used before eviction (None before any prefetch)."""
        return self.prefetch_used / self.prefetched if self.prefetched else None


def format_stats(stats: StoreStats) -> str:
    """A per-layer table of hits, misses, MiB read per tier and prefetch use, then the totals."""
    head = f"{'layer':>5} {'hits':>8} {'misses':>8} {'hit%':>6} {'disk MiB':>9} {'host MiB':>9} " \
           f"{'prefetch':>8} {'used':>6}"
    rows = [head]

    def row(name: str, s: Any) -> str:
        total = s.hits + s.misses
        rate = 100.0 * s.hits / total if total else 100.0
        return (f"{name:>5} {s.hits:>8} {s.misses:>8} {rate:>6.1f} {s.bytes_from_disk / 2**20:>9.1f} "
                f"{s.bytes_from_host / 2**20:>9.1f} {s.prefetched:>8} {s.prefetch_used:>6}")

    for layer in sorted(stats.layers):
        rows.append(row(str(layer), stats.layers[layer]))
    rows.append(row("all", stats))
    accuracy = stats.prefetch_accuracy
    harm = f" ({stats.prefetch_harm} units it evicted were missed next)" if stats.prefetched else ""
    rows.append(f"hit rate {100 * stats.hit_rate:.1f}%, prefetch accuracy "
                f"{'n/a' if accuracy is None else f'{100 * accuracy:.1f}%'}{harm}, load errors {stats.load_errors}, "
                f"compute thread waited {stats.wait_seconds:.2f} s on reads ({stats.read_seconds:.2f} s reading)")
    return "\n".join(rows)


class _AnyOf:
    """Membership in any of several sets, without building their union (a prefetch victim's exclusions)."""

    def __init__(self, *sets: Container[Key]) -> None:
        self._sets = sets

    def __contains__(self, key: object) -> bool:
        return any(key in s for s in self._sets)


class SlotCache:
    """The map (layer, expert) -> slot of a fast tier of `capacity` slots, with pins, prefetch protection, the
    eviction policy's calls and the hit/miss/byte counts. `policy` None: every unit is placed once at start-up
    (`place`) and never evicted (a resident store); only hits are counted then (`count_resident_hits`)."""

    def __init__(self, capacity: int, policy: EvictionPolicy | None, layers: Iterable[int] = (),
                 on_map: Callable[[Key, int], None] | None = None, quota: CacheQuota | None = None) -> None:
        """`layers`: their statistics exist from the start (readers on other threads never see the dict grow).
        `on_map(key, slot)` hears every change of the map: a slot when `key` becomes ready, -1 when it leaves.
        `quota`: how the slots are shared among the layers (None: one shared pool)."""
        if capacity < 1:
            raise MoeserveError(f"slot cache: capacity={capacity} must be >= 1")
        layers = list(layers)
        self.capacity = capacity
        self.policy = policy
        self.quota = quota if quota is not None else make_quota("shared", capacity, layers)
        if self.quota.capacity != capacity:
            raise MoeserveError(f"slot cache: quota for {self.quota.capacity} slots, cache of {capacity}")
        self.stats = StoreStats()
        for layer in layers:
            self.stats.layer(layer)
        self._held: dict[int, int] = {}  # layer -> its slots, ready or loading (the quota's count)
        self._on_map = on_map
        self._slot_of: dict[Key, int] = {}  # ready units
        self._loading: dict[Key, int] = {}  # units being written into a slot: neither free nor mapped
        self._free = list(range(capacity - 1, -1, -1))  # popped from the end: slot 0 first
        self._pinned: set[Key] = set()  # the chunk the caller is computing
        self._protected: set[Key] = set()  # kept from prefetch victims until the next layer call begins
        self._unused_prefetch: set[Key] = set()  # prefetched, not needed yet
        self._prefetch_victims: dict[int, set[Key]] = {}  # layer -> its keys a prefetch evicted since its last call
        # (miss, victim) that `admits` weighed: `take_miss_slot(miss)` evicts that victim without asking the policy
        # again. Any other call that changes the cache (pins, policy calls, the map, protection) forgets it.
        self._kept_victim: tuple[Key, Key] | None = None

    # ------------------------------------------------------------------------------------------- queries
    def slot(self, key: Key) -> int | None:
        """The slot of `key` when its unit is ready, else None."""
        return self._slot_of.get(key)

    def slots(self, keys: Iterable[Key]) -> list[int]:
        """The slots of `keys`, every one ready (KeyError otherwise)."""
        slot_of = self._slot_of
        return [slot_of[k] for k in keys]

    def holds(self, key: Key) -> bool:
        """`key` is ready or being loaded: reading it again would be wasted."""
        return key in self._slot_of or key in self._loading

    def loading_any(self, keys: Iterable[Key]) -> bool:
        loading = self._loading
        return any(k in loading for k in keys)

    def cached_keys(self) -> set[Key]:
        return set(self._slot_of)

    def slot_map(self) -> dict[Key, int]:
        """A copy of the map of ready units."""
        return dict(self._slot_of)

    def chunk_limit(self, layer: int) -> int:
        """Most experts one chunk of a `layer` call may pin (the capacity, or less under a per-layer quota)."""
        return self.quota.chunk_limit(layer)

    def held(self, layer: int) -> int:
        """Slots `layer` holds, ready or loading."""
        return self._held.get(layer, 0)

    @property
    def pinned_keys(self) -> frozenset[Key]:
        return frozenset(self._pinned)

    @property
    def loading_keys(self) -> frozenset[Key]:
        return frozenset(self._loading)

    @property
    def protected_keys(self) -> frozenset[Key]:
        return frozenset(self._protected)

    # ----------------------------------------------------------------------------------- hits, layer calls
    def place(self, key: Key) -> int:
        """Start-up: `key` into a free slot, ready at once (its bytes are written before anyone asks). No policy
        call, nothing counted."""
        self._kept_victim = None
        slot = self._free.pop()
        self._publish(key, slot)
        self._held[key[0]] = self._held.get(key[0], 0) + 1
        return slot

    def pin(self, keys: Iterable[Key]) -> None:
        self._kept_victim = None
        self._pinned.update(keys)

    def release(self, keys: Iterable[Key]) -> None:
        """The caller is done with `keys` (`pin`, `begin_call`, `all_cached`)."""
        self._kept_victim = None
        self._pinned.difference_update(keys)

    def begin_call(self, layer: int, keys: Sequence[Key]) -> list[Key]:
        """One chunk of a layer call, after `pin(keys)` and once none of `keys` is loading: the policy's
        `begin_layer`, then every ready key counted and told as a hit, in order. Returns the misses, in order;
        give each its slot with `take_miss_slot`."""
        self._start_call(layer)
        slot_of = self._slot_of
        hits = [k for k in keys if k in slot_of]
        self._count_hits(layer, hits)
        misses = [k for k in keys if k not in slot_of] if len(hits) < len(keys) else []
        victims = self._prefetch_victims.pop(layer, None) if self._prefetch_victims else None
        if victims and misses:
            self.stats.layer(layer).prefetch_harm += sum(1 for k in misses if k in victims)
        return misses

    def all_cached(self, layer: int, keys: Sequence[Key]) -> list[int] | None:
        """When every key is ready: `begin_call` (all hits) and `pin`, and return their slots. Otherwise None
        with nothing changed."""
        slot_of = self._slot_of
        slots = [slot_of.get(k, -1) for k in keys]
        if -1 in slots:
            return None
        self.record_call(layer, keys)
        self._pinned.update(keys)
        return slots

    def record_call(self, layer: int, keys: Sequence[Key]) -> None:
        """A layer call that found every key ready and ran without pinning (the caller's stack held the slots):
        counted and told to the policy exactly as `begin_call` does."""
        self._start_call(layer)
        self._count_hits(layer, keys)
        if self._prefetch_victims:
            self._prefetch_victims.pop(layer, None)

    def count_resident_hits(self, layer: int, hits: int) -> None:
        """Cache without a policy (everything resident): `hits` needed experts of `layer`, served from slots."""
        if self.policy is not None:
            raise MoeserveError("count_resident_hits: this cache evicts; report the calls' keys (record_call)")
        self.stats.layers[layer].hits += hits

    def _start_call(self, layer: int) -> None:
        self._kept_victim = None
        if self.policy is not None:
            self.policy.begin_layer(layer)
        if self._protected:  # the prefetch window ends where the next layer call begins
            self._protected.clear()

    def _count_hits(self, layer: int, keys: Sequence[Key]) -> None:
        """The one place hits are counted (and told to the policy)."""
        st = self.stats.layer(layer)
        st.hits += len(keys)
        if self.policy is not None:
            on_hit = self.policy.on_hit
            for key in keys:
                on_hit(key)
        if self._unused_prefetch:
            used = [k for k in keys if k in self._unused_prefetch]
            self._unused_prefetch.difference_update(used)
            st.prefetch_used += len(used)

    # ------------------------------------------------------------------------------------------- reads
    def take_miss_slot(self, key: Key) -> int | None:
        """A slot for the demand miss `key` (free, or an unpinned victim's): `key` is loading, inserted in the
        policy and counted as a miss. None: every ready unit is pinned and other slots are loading; ask again
        once one of them lands. Raises MoeserveError when no slot can ever come (more pinned than slots).
        Right after `admits(key)`, the victim it weighed is the one evicted (the policy is not asked twice)."""
        kept, self._kept_victim = self._kept_victim, None
        slot = self._slot_for(key, self._pinned, victim=kept[1] if kept is not None and kept[0] == key else None)
        if slot is None:
            if all(k in self._pinned for k in self._loading):
                raise MoeserveError("expert cache: no evictable slot although nothing is loading; "
                                    "the cache is smaller than the pinned chunk")
            return None
        self._loading[key] = slot
        assert self.policy is not None
        self.policy.on_insert(key)
        self.stats.layer(key[0]).misses += 1
        return slot

    def admits(self, key: Key) -> bool:
        """Admission control (the store's expert_admission=policy, the simulator's admission=True): whether the
        demand miss `key` should take a slot (`take_miss_slot`) rather than be served uncached (`bypass`). True
        while a free slot is allowed; else the policy's `admit(key, victim)` for the victim `take_miss_slot` would
        choose. That victim is kept for `take_miss_slot(key)` until anything else changes the cache."""
        assert self.policy is not None
        self._kept_victim = None
        layer = key[0]
        if self._free and self.quota.may_grow(layer, self._held.get(layer, 0)):
            return True
        layers = self.quota.victim_layers(layer, self._held)
        try:
            victim = self.policy.choose_victim(self._pinned, layers)
        except NoVictimError:
            return True  # nothing to weigh against: take_miss_slot waits or fails as without admission
        if self.policy.admit(key, victim):
            self._kept_victim = (key, victim)
            return True
        return False

    def bypass(self, key: Key) -> None:
        """The demand miss `key` read into a buffer, used and dropped: counted as a miss, told to the policy as a
        use (`on_bypass`), never mapped."""
        assert self.policy is not None
        self._kept_victim = None
        self.policy.on_bypass(key)
        st = self.stats.layer(key[0])
        st.misses += 1
        st.bypassed += 1

    def protect(self, keys: Iterable[Key]) -> None:
        """Keep `keys` from prefetch victims until the next layer call begins (or `end_protection`)."""
        self._kept_victim = None
        self._protected.update(keys)

    def end_protection(self) -> None:
        self._kept_victim = None
        self._protected.clear()

    def plan_prefetch(self, keys: Iterable[Key]) -> list[Key]:
        """Predicted `keys`, most likely first: those ready or loading are protected; the rest, in order, are
        returned to be read (each through `take_prefetch_slot`)."""
        self._kept_victim = None
        todo = []
        for key in keys:
            if self.holds(key):
                self._protected.add(key)
            else:
                todo.append(key)
        return todo

    def take_prefetch_slot(self, key: Key) -> int | None:
        """A slot to prefetch `key` into: free, or the victim's of one neither pinned, loading nor protected;
        None when there is none (stop prefetching). `key` is loading and protected; the policy hears of it when
        it lands (`finish_read(prefetched=True)`)."""
        self._kept_victim = None
        slot = self._slot_for(key, _AnyOf(self._pinned, self._protected, self._loading), by_prefetch=True)
        if slot is None:
            return None
        self._loading[key] = slot
        self._protected.add(key)
        return slot

    def finish_read(self, key: Key, nbytes: int = 0, *, from_host: bool = False, prefetched: bool = False) -> None:
        """`key`'s unit landed in its slot (`nbytes` read from the host tier or the disk): it is ready."""
        self._kept_victim = None
        slot = self._loading.pop(key)
        self._publish(key, slot)
        st = self.stats.layer(key[0])
        if from_host:
            st.bytes_from_host += nbytes
        else:
            st.bytes_from_disk += nbytes
        if prefetched:
            assert self.policy is not None
            self.policy.on_insert(key, prefetched=True)
            st.prefetched += 1
            self._unused_prefetch.add(key)

    def abandon_read(self, key: Key, *, prefetched: bool = False) -> None:
        """A read of `key` that will not land: its slot holds garbage, maps to nothing, and is free again."""
        self._kept_victim = None
        slot = self._loading.pop(key, None)
        if slot is None:
            return
        self._free.append(slot)
        self._held[key[0]] -= 1
        self._protected.discard(key)
        if not prefetched:  # a demand miss was inserted when it took its slot
            assert self.policy is not None
            self.policy.on_evict(key)

    # ------------------------------------------------------------------------------------------ internals
    def _slot_for(self, key: Key, keep: Container[Key], by_prefetch: bool = False, victim: Key | None = None
                  ) -> int | None:
        """A slot for a read of `key`: a free one while its layer may grow, else a victim's outside `keep` from
        the layers the quota allows (`victim`: the one `admits` chose); None when there is none. The slot counts
        for `key`'s layer from now."""
        layer = key[0]
        held = self._held.get(layer, 0)
        if self._free and self.quota.may_grow(layer, held):
            slot: int | None = self._free.pop()
        else:
            slot = self._evict(keep, self.quota.victim_layers(layer, self._held), by_prefetch, victim)
        if slot is not None:
            self._held[layer] = self._held.get(layer, 0) + 1
        return slot

    def _evict(self, keep: Container[Key], layers: Container[int] | None, by_prefetch: bool = False,
               victim: Key | None = None) -> int | None:
        """The slot of the policy's victim outside `keep` (and in `layers`), now unmapped; None when every ready
        key is kept. `by_prefetch`: remembered until its layer's next call (`prefetch_harm`). `victim`: already
        chosen by the policy for this very state (`admits`)."""
        assert self.policy is not None, "a cache without a policy never evicts"
        if victim is None:
            try:
                victim = self.policy.choose_victim(keep) if layers is None else self.policy.choose_victim(keep, layers)
            except NoVictimError:
                return None
        self._held[victim[0]] -= 1
        if by_prefetch:
            self._prefetch_victims.setdefault(victim[0], set()).add(victim)
        slot = self._slot_of.pop(victim)
        if self._on_map is not None:
            self._on_map(victim, -1)
        self.policy.on_evict(victim)
        self._unused_prefetch.discard(victim)
        return slot

    def _publish(self, key: Key, slot: int) -> None:
        self._slot_of[key] = slot
        if self._on_map is not None:
            self._on_map(key, slot)
