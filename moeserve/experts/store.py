"""ExpertStore: the only owner of expert weights. The MoE layer asks it for exactly the experts it needs.

    for chunk in store.experts(layer, expert_ids):      # expert_ids ascending, unique
        for expert_id, weights in chunk:                 # weights: typed views of the unit's fields
            ...

The store keeps a pool of `capacity` slots in the fast tier, each one ExpertUnit. Which unit is in which slot, the
pins, the eviction policy's calls, prefetch protection and the counters are a `SlotCache` (experts/slot_cache.py:
pure, the same class `moeserve simulate` replays traces through); the store wraps it in one condition variable
and moves the bytes. A needed expert that is cached is a hit; otherwise it is loaded from a slower tier (see
`tiers.Loader`) into a free slot or the slot of a victim chosen by the eviction policy. Experts of the chunk being
computed are pinned: never evicted under it. When a layer needs more experts than there are slots, they come in
several chunks, in ascending expert order, so the MoE layer adds their outputs in the same order as when
everything is resident: placement never changes a bit of the result.

"Everything resident" is the case capacity >= number of experts: all units are loaded at start-up, never move, and
every access is a hit (no policy, no second code path for the callers).

Threads: the compute thread calls `experts`; I/O threads read its misses (experts/reads.py); a `Prefetcher` thread
may load predicted experts meanwhile (experts/prefetch/prefetcher.py). They share the store's one condition variable and its
cache. A slot being filled belongs to its reader alone (loading in the cache: neither free nor mapped), so no
thread ever reads a half-written unit.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from moeserve.checkpoint.finite import check_loaded_units
from moeserve.checkpoint.safetensors_file import DIRECT_ALIGN
from moeserve.errors import MoeserveError
from moeserve.experts.bypass import BypassReads
from moeserve.experts.policies import DeferredHits, EvictionPolicy, make_policy
from moeserve.experts.prefetch.guess import OnlineGuesses, Predictor
from moeserve.experts.prefetch.prefetcher import Prefetcher
from moeserve.experts.quota import make_quota
from moeserve.experts.reads import MissReader, Read
from moeserve.experts.slot_cache import Key, LayerStats, SlotCache, StoreStats, format_stats
from moeserve.experts.tiers import HostTier, Loader, Tier
from moeserve.experts.transfer import HostToDevice
from moeserve.experts.unit import ExpertSource
from moeserve.experts.verify import ReferenceScan
from moeserve.memory.device import CudaOps, DeviceOps
from moeserve.memory.hugepages import huge_page_bytes, thp_mode

__all__ = ["ExpertStore", "ExpertWeights", "LayerStats", "StoreOptions", "StoreStats", "format_stats"]

log = logging.getLogger("moeserve")

ExpertWeights = tuple[torch.Tensor, ...]  # views of one unit's fields, in layout order
Chunk = list[tuple[int, ExpertWeights]]  # (expert id, its weights), ascending


@dataclass(frozen=True)
class StoreOptions:
    """How the store is built beyond its capacity: the policy, the host tier, prefetch, the device ops."""

    policy: str = "lfru"
    policy_options: dict[str, Any] = field(default_factory=dict)
    host_capacity: int = 0  # units in the host RAM tier (CUDA machines); 0 = none
    prefetch: bool = False
    ops: DeviceOps | None = None  # None: CudaOps on a CUDA device, nothing on CPU (tests pass a fake)
    # Threads reading the misses of one chunk at the same time (the disk serves several requests at once, and
    # the compute thread works on the experts already in meanwhile); 0 = the compute thread reads them in turn.
    io_threads: int = 2
    # What prefetch loads: "affinity" = the experts the store's own guesses (experts/prefetch/guess.py: an AffinityPredictor
    # learned online from the layers' accesses) give at least `prefetch_min_prob` chance of being used by the next
    # layer; "hint" = the guess the caller passes to `experts(..., prefetch=)`.
    prefetch_predictor: str = "affinity"
    prefetch_min_prob: float = 0.5
    cache_mode: str = "shared"  # how the slots are shared among layers: shared, per_layer, mixed (experts/quota.py)
    # prefetch=auto: the affinity guesses are read only while they pay (experts/prefetch/auto.py)
    prefetch_auto: bool = False
    # Admission control: "always" = every demand miss takes a slot (evicting a victim); "policy" = a miss the policy
    # does not `admit` against its victim is read into a bypass buffer, lent, dropped; the victim stays.
    admission: str = "always"


ADMISSION_MODES = ("always", "policy")
# Bypass buffers (admission=policy; experts/bypass.py): 3 read ahead by I/O threads, 1 by the compute thread.
BYPASS_BUFFERS = 4


class ExpertStore:
    """A budgeted cache of expert units in the fast tier, backed by slower tiers (host RAM, the checkpoint)."""

    def __init__(
        self,
        source: ExpertSource,
        layers: Sequence[int],
        num_experts: int,
        capacity: int,
        device: torch.device,
        policy: str = "lfru",
        progress: Callable[[int], None] | None = None,
        options: StoreOptions | None = None,
    ) -> None:
        opts = options or StoreOptions(policy=policy)
        if opts.admission not in ADMISSION_MODES:
            raise MoeserveError(f"unknown expert admission {opts.admission!r} ({', '.join(ADMISSION_MODES)})")
        self.source = source
        self.layout = source.layout
        self.layers = list(layers)
        self.num_experts = num_experts
        self.total_experts = len(self.layers) * num_experts
        self.capacity = max(1, min(capacity, self.total_experts))
        self.device = device
        self.resident = self.capacity >= self.total_experts
        self.admission = opts.admission == "policy" and not self.resident
        self.bypass_buffers = (BYPASS_BUFFERS if opts.io_threads > 0 else 1) if self.admission else 0
        self._cond = threading.Condition()  # guards the cache, the prefetcher's requests and the time counters
        self._make_slots()
        evict: EvictionPolicy | None = None
        if not self.resident:
            # Hits are told to the policy in batches (DeferredHits: the same calls, the same choices, warm caches).
            evict = DeferredHits(make_policy(opts.policy, **opts.policy_options))
        quota = make_quota(opts.cache_mode if not self.resident else "shared", self.capacity, self.layers)
        self.cache = SlotCache(self.capacity, evict, self.layers, self._map, quota)
        self.stats = self.cache.stats
        self._make_tiers(opts)
        self.prefetcher: Prefetcher | None = None
        self.prefetch_min_prob = opts.prefetch_min_prob
        self.source_note: str | None = None
        self.reference_scan: ReferenceScan | None = None  # start_reference_scan
        if self.resident:
            self._load_everything(progress)
            return
        self.source_note = source.prepare_offload()
        checksum_name, checksums = source.known_checksums()  # e.g. a spill file's header
        if checksums and self.loader.verifier is not None:
            self.loader.verifier.seed(checksums, checksum_name)
        if opts.prefetch:
            if opts.prefetch_predictor not in ("affinity", "hint"):
                raise MoeserveError(f"unknown prefetch_predictor {opts.prefetch_predictor!r} (affinity, hint)")
            own = opts.prefetch_predictor == "affinity"
            auto = self.cache.stats if opts.prefetch_auto else None
            guesses = OnlineGuesses(num_experts, opts.prefetch_min_prob, auto=auto) if own else None
            self.prefetcher = Prefetcher(self._cond, self.cache, self._fill, self.layers, guesses)

    def _make_slots(self) -> None:
        """The pool, one [unit_nbytes] uint8 row per slot, its views (built once: nothing per call) and the
        slot table. On CPU every decode step streams the pool: 2 MiB pages where the kernel allows. The rows after
        the `capacity` slots are the bypass buffers (admission=policy): lent like slots, never mapped."""
        nbytes = self.layout.nbytes
        rows = self.capacity + self.bypass_buffers
        self.huge_pages = False
        if self.device.type == "cpu":
            flat, self.huge_pages = huge_page_bytes(rows * nbytes)
            self._pool = flat.view(rows, nbytes)
        else:
            self._pool = torch.empty(rows, nbytes, dtype=torch.uint8, device=self.device)
        self._slot_views: list[ExpertWeights] = [self.layout.views(self._pool[s]) for s in range(rows)]
        # The cache's map as a table for C++ (the DecodeStack runs layers whose experts are all cached without
        # asking, see report_cached_calls): slot_table[i, e] = the slot of expert e of self.layers[i], -1 if not
        # ready. Written through the numpy view (~100 ns a write) by `_map`, which the cache calls on every change.
        self.slot_table = torch.full((len(self.layers), self.num_experts), -1, dtype=torch.int32)
        self._slot_rows = self.slot_table.numpy()
        self._row_of = {layer: i for i, layer in enumerate(self.layers)}

    def _make_tiers(self, opts: StoreOptions) -> None:
        ops = opts.ops if opts.ops is not None else (CudaOps(self.device) if self.device.type == "cuda" else None)
        slots = self.capacity + self.bypass_buffers
        self.copier = HostToDevice(ops, slots, self.layout.nbytes) if ops is not None else None
        host = None
        if opts.host_capacity > 0 and not self.resident:
            host = HostTier(min(opts.host_capacity, self.total_experts), self.layout.nbytes, self.copier)
        self.loader = Loader(self.source, self.device, self.copier, host, verify=not self.resident)
        self._misses = MissReader(self._cond, self.cache, self._fill, 0 if self.resident else opts.io_threads)
        self.io_threads = self._misses.io_threads

    # ------------------------------------------------------------------------------------------- public
    @property
    def policy(self) -> EvictionPolicy | None:
        """The eviction policy (None when everything is resident)."""
        return self.cache.policy

    @property
    def guesses(self) -> OnlineGuesses | None:
        """The store's own prefetch guesses, learned from its layer calls (None: no prefetch, or hints)."""
        return self.prefetcher.guesses if self.prefetcher is not None else None

    @property
    def predictor(self) -> Predictor | None:
        """The store's own prefetch predictor (None: no prefetch, or the caller's hints)."""
        return self.guesses.predictor if self.guesses is not None else None

    @property
    def takes_hints(self) -> bool:
        """Whether prefetch loads the caller's guesses (`experts(..., prefetch=)`): only then are they worth making."""
        return self.prefetcher is not None and self.guesses is None

    @property
    def unit_nbytes(self) -> int:
        return self.layout.nbytes

    @property
    def cache_nbytes(self) -> int:
        return self.capacity * self.layout.nbytes

    @property
    def host_nbytes(self) -> int:
        return self.loader.host.nbytes if self.loader.host is not None else 0

    def describe(self) -> str:
        """One line for the start-up log: tiers, sizes, transfer mode, policy, prefetch."""
        pages = ""
        if self.device.type == "cpu":
            pages = ", 2 MiB pages (madvise)" if self.huge_pages else f", 4 KiB pages (THP {thp_mode()})"
        parts = [f"fast tier ({self.device.type}) {self.capacity} of {self.total_experts} experts "
                 f"({self.cache_nbytes / 2**20:.1f} MiB{pages})"]
        if self.loader.host is not None:
            # the pinned bytes (power-of-two chunks; what failed to pin and why): memory/pinned.py
            parts.append(f"host tier {self.loader.host.capacity} experts ({self.loader.host.describe()})")
        if self.copier is not None:
            parts.append(f"transfers: {self.copier.mode.reason}")
        if self.policy is None:
            return "; ".join(parts + ["all experts resident"])
        how = "off"
        if self.guesses is not None and self.guesses.auto is not None:
            how = (f"auto (read while the misses it saves pay for its reads, >= {self.guesses.auto.min_gain:.2f} "
                   "per read, re-checked online; starts off, measuring)")
        elif self.prefetcher is not None:
            how = (f"on (experts the affinity predictor learned online gives >= {self.prefetch_min_prob:.0%} "
                   "chance in the next layer, read only while such guesses not in the cache were used as often)"
                   if self.guesses is not None else "on (the caller's guesses)")
        parts.append(f"policy {self.policy.name}, cache mode {self.cache.quota.describe()}, prefetch {how}")
        parts.append(f"admission policy (a miss the policy does not admit against its victim is read into one of "
                     f"{self.bypass_buffers} bypass buffers ({self.layout.nbytes / 2**20:.1f} MiB each, in the read "
                     "buffers), used once and dropped; the victim stays)" if self.admission else
                     "admission always (every miss is cached, evicting a victim)")
        if self.source_note:
            parts.append(self.source_note)
        parts.append(f"misses read by {self.io_threads} I/O threads + the compute thread, overlapped with "
                     "the compute of experts already in" if self.io_threads else
                     "misses read by the compute thread in turn")
        parts.append(f"{'O_DIRECT' if self._direct_reads() else 'page-cache'} reads, read buffers up to "
                     f"{self.staging_nbytes / 2**20:.1f} MiB")
        return "; ".join(parts)

    def prefetch_decision(self) -> tuple[bool, str] | None:
        """prefetch=auto: whether it reads now, and why (None: prefetch is not auto)."""
        auto = self.guesses.auto if self.guesses is not None else None
        return (auto.on, auto.reason) if auto is not None else None

    def experts(self, layer: int, expert_ids: Sequence[int],
                prefetch: tuple[int, Sequence[int]] | None = None) -> Iterator[Chunk]:
        """Yield the needed experts in chunks that fit the cache, ascending by expert id.

        Each chunk's experts are pinned until the next chunk is requested (or the generator ends).
        `prefetch` = (next layer, predicted expert ids, most likely first), used when the store takes hints: once
        this layer's experts are in, the prefetcher loads them (only when this layer fits in one chunk, so it
        cannot evict any of this layer's experts). A load failure raises ExpertLoadError; the store stays
        consistent.
        """
        if self.resident:
            with self._cond:
                self.cache.count_resident_hits(layer, len(expert_ids))
            held = self.cache.slots((layer, e) for e in expert_ids)
            yield [(e, self._slot_views[s]) for e, s in zip(expert_ids, held)]
            return
        limit = self.cache.chunk_limit(layer)  # the capacity, or less under a per-layer quota
        if self.prefetcher is None and len(expert_ids) <= limit:
            # Decode's common case, every expert cached: the general path below minus its machinery for misses
            # (same policy calls, pins and statistics). Each call runs right after a layer's compute has streamed
            # tens of MB through the CPU caches, so every line of Python here is a cache miss.
            keys = [(layer, e) for e in expert_ids]
            with self._cond:
                slots = self.cache.all_cached(layer, keys)
            if slots is not None:
                try:
                    yield from self._lend(expert_ids, slots)
                finally:
                    with self._cond:
                        self.cache.release(keys)
                return
        ids = list(expert_ids)
        if self.prefetcher is not None:
            self.prefetcher.observe(layer, ids)
        chunks = [ids[i : i + limit] for i in range(0, len(ids), limit)]
        for chunk in chunks:
            keys = [(layer, e) for e in chunk]
            pending: dict[Key, Read] = {}  # key -> its read in flight (the misses)
            # misses the policy did not admit: read into bypass buffers (experts/bypass.py)
            bypassed = BypassReads(self._fill, self._cond, self.stats, range(self.capacity, self._pool.shape[0]),
                                   self._misses.submit if self.io_threads else None)
            try:
                pending = self._acquire(layer, keys, bypassed)
                if len(chunks) == 1 and self.prefetcher is not None:
                    self.prefetcher.after_acquire(layer, keys, prefetch)
                yield from self._lend_as_landed(chunk, keys, pending, bypassed)
            finally:
                self._misses.settle(pending)  # the caller stopped early or a read failed: let the others land
                bypassed.settle()
                with self._cond:
                    self.cache.release(keys)

    @property
    def calls_may_skip(self) -> bool:
        """Whether a caller may compute a layer whose experts are all ready in `slot_table` without asking
        `experts`, then report it with `report_cached_calls`: offloaded, on CPU, and nothing evicts behind the
        caller's back (no prefetch thread; a call's demand reads have all landed when it returns). Not with device
        ops (a fake fast tier on CPU in tests): a slot's copy is only waited for by `experts`."""
        return not self.resident and self.prefetcher is None and self.device.type == "cpu" and self.copier is None

    def slot_units(self) -> list[ExpertWeights]:
        """The views of every slot of the fast tier, by slot (fixed for the store's life; see `slot_table`)."""
        return self._slot_views[: self.capacity]

    def report_cached_calls(self, log: Sequence[int] = (), hits_per_layer: Sequence[int] = ()) -> None:
        """Layer calls a caller ran on units it found ready without asking `experts` (the C++ decode stack).

        `log`: such calls on slots of `slot_table` (`calls_may_skip`), in order, flat: (index in self.layers,
        count, expert ids...) each; counted and told to the policy as `experts` does for an all-hit call.
        `hits_per_layer`: a resident store only (no policy to tell), needed experts per entry of self.layers, for
        calls on `resident_units`.
        """
        with self._cond:
            i = 0
            while i < len(log):
                layer, n = self.layers[log[i]], log[i + 1]
                self.cache.record_call(layer, [(layer, e) for e in log[i + 2 : i + 2 + n]])
                i += 2 + n
            for layer, hits in zip(self.layers, hits_per_layer):
                self.cache.count_resident_hits(layer, hits)

    def resident_units(self, layer: int) -> list[ExpertWeights]:
        """Resident store only: the views of every expert of `layer`, by expert id. They never move or get evicted
        (a resident store loads each unit once into its own slot), so a caller may hold them for the process's
        life; it then reports its uses with `report_cached_calls(hits_per_layer=...)`."""
        if not self.resident:
            raise MoeserveError("resident_units: the store is not resident (experts move between tiers)")
        return [self._slot_views[s] for s in self.cache.slots((layer, e) for e in range(self.num_experts))]

    def prefetch(self, layer: int, expert_ids: Sequence[int]) -> None:
        """A hint that `layer` will soon need `expert_ids` (most likely first). No-op when resident or off."""
        if self.prefetcher is not None:
            self.prefetcher.hint(layer, expert_ids)

    def cancel_prefetch(self) -> None:
        """Drop the pending guesses, their protection, and stop the one being loaded after its current unit (e.g.
        the step ended: a guess for a layer of this step is stale). No-op without prefetch."""
        if self.prefetcher is not None:
            with self._cond:
                self.prefetcher.cancel()

    def cached_keys(self) -> set[Key]:
        """The (layer, expert) units ready in the fast tier now."""
        with self._cond:
            return self.cache.cached_keys()

    def start_reference_scan(self, idle: Callable[[], bool]) -> ReferenceScan | None:
        """Offloaded: read, in the background while `idle()`, each unit that has no reference checksum yet and
        record it (experts/verify.py), so a unit that changes on disk later is caught at its next miss."""
        verifier = self.loader.verifier
        if verifier is None or self.reference_scan is not None:
            return self.reference_scan
        keys = [(layer, e) for layer in self.layers for e in range(self.num_experts)]
        self.reference_scan = ReferenceScan(verifier, keys, self.layout.nbytes,
                                            lambda key, out: self.source.read_unit(key[0], key[1], out), idle)
        self.reference_scan.start()
        return self.reference_scan

    @property
    def staging_nbytes(self) -> int:
        """Read buffers besides the slots: the source's shared staging, plus per reading thread (the I/O threads,
        the compute thread, the prefetcher) the source's own scratch and, when misses use O_DIRECT, one aligned
        buffer for a unit's byte range. Allocated on a thread's first miss; nothing when all experts are resident."""
        if self.resident:
            return self.source.staging_nbytes
        threads = self.io_threads + 1 + (1 if self.prefetcher is not None else 0)
        scan = self.layout.nbytes if self.loader.verifier is not None else 0  # the reference scan's unit (+ thread)
        threads += 1 if scan else 0
        per_thread = self.source.per_thread_staging_nbytes
        if self._direct_reads():
            per_thread += self.source.stored_nbytes + 2 * DIRECT_ALIGN
        bypass = self.bypass_buffers * self.layout.nbytes  # admission=policy: rows of the pool beside the slots
        return self.source.staging_nbytes + threads * per_thread + scan + bypass

    def _direct_reads(self) -> bool:
        return bool(getattr(getattr(self.source.checkpoint, "reader", None), "direct", False))

    def close(self) -> None:
        """Stop the threads, close the files and free the pool of slots (and its views) now; counters stay readable."""
        if self.reference_scan is not None:
            self.reference_scan.stop()
        if self.prefetcher is not None:
            self.prefetcher.close()
        self._misses.close()
        if self.loader.host is not None:
            self.loader.host.close()  # its pinned chunks go back to the OS now, not at exit (memory/pinned.py)
        self.source.close()
        self.source.checkpoint.close()
        self._slot_views, self._pool = [], torch.empty(0, self.layout.nbytes, dtype=torch.uint8)  # not a view of it

    # ------------------------------------------------------------------------------------------ internals
    def _lend(self, expert_ids: Sequence[int], slots: list[int]) -> Iterator[Chunk]:
        """Yield the views of `slots` (ready, pinned) as one run of the caller's chunk; on a device, each slot's
        transfer is waited for before use and released after (HostToDevice)."""
        if self.copier is not None:
            for slot in slots:
                self.copier.before_use(slot)
        try:
            yield [(e, self._slot_views[s]) for e, s in zip(expert_ids, slots)]
        finally:
            if self.copier is not None:
                self.copier.after_use(slots)

    def _lend_as_landed(self, chunk: list[int], keys: list[Key], pending: dict[Key, Read],
                        bypassed: BypassReads) -> Iterator[Chunk]:
        """Yield the chunk in ascending runs of experts that are in, so the caller computes them while the misses
        after them are still being read; the order of experts never changes. Takes the reads it waits for out of
        `pending`. A `bypassed` key is lent from its bypass buffer: in the run before it once read ahead and
        landed, else (read here, into the shared last buffer) at the start of its own run."""
        i = 0
        while i < len(keys):
            j = i + 1
            while j < len(keys) and (bypassed.landed(keys[j]) if keys[j] in bypassed
                                     else keys[j] not in pending or pending[keys[j]].landed):
                j += 1
            yield from self._lend(chunk[i:j], self._rows(keys[i:j], pending, bypassed))
            i = j

    def _rows(self, keys: list[Key], pending: dict[Key, Read], bypassed: BypassReads) -> list[int]:
        """The pool row of each of a run's keys (a bypass buffer or its slot), once its read has landed."""
        buffers: dict[Key, int] = {}
        for key in keys:
            if key in bypassed:
                t0 = time.perf_counter()
                buffers[key] = bypassed.take(key)
                with self._cond:
                    self.stats.wait_seconds += time.perf_counter() - t0
            elif key in pending:
                self._misses.wait(pending.pop(key))  # done unless it starts the run: re-raises its error, if any
        with self._cond:
            slots = iter(self.cache.slots([k for k in keys if k not in buffers]))
        return [buffers[k] if k in buffers else next(slots) for k in keys]

    def _acquire(self, layer: int, keys: list[Key], bypassed: BypassReads) -> dict[Key, Read]:
        """Pin `keys`, wait for any of them in flight, count hits, start reading the misses; the reads started.

        Every miss gets its slot (and its `on_insert`) here, in ascending order as the simulator does; its
        bytes land later, on an I/O thread or the compute thread (experts/reads.py). With admission=policy a miss
        the policy refuses gets no slot: it is counted (`on_bypass`) and its read into a bypass buffer started.
        """
        cache = self.cache
        slots: dict[Key, int] = {}
        refused: list[Key] = []
        with self._cond:
            if self.prefetcher is not None:
                self.prefetcher.cancel()  # any pending guess is for this layer or older: demand loads take over
            cache.pin(keys)
            if cache.loading_any(keys):
                t0 = time.perf_counter()
                while cache.loading_any(keys):
                    self._cond.wait()
                self.stats.wait_seconds += time.perf_counter() - t0
            try:
                for key in cache.begin_call(layer, keys):
                    if self.admission and not cache.admits(key):
                        cache.bypass(key)
                        refused.append(key)
                        continue
                    slot = cache.take_miss_slot(key)
                    while slot is None:  # every ready unit is pinned: prefetches in flight free slots when done
                        self._cond.wait()
                        slot = cache.take_miss_slot(key)
                    slots[key] = slot
            except BaseException:
                for key in slots:
                    cache.abandon_read(key)
                self._cond.notify_all()
                raise
        pending = self._misses.start(keys, slots) if slots else {}
        bypassed.start(refused)  # after the misses: the I/O threads read those first
        return pending

    def _fill(self, key: Key, slot: int) -> tuple[int, bool]:
        """Read `key`'s unit into `slot` (taken for it, no lock held): (bytes read, served by the host tier)."""
        tier = self.loader.load(key, slot, self._pool[slot])
        return (self.layout.nbytes, True) if tier is Tier.HOST else (self.source.stored_nbytes, False)

    def _map(self, key: Key, slot: int) -> None:
        """(Lock held, or no other thread yet.) The cache's map changed: mirror it in `slot_table`."""
        self._slot_rows[self._row_of[key[0]], key[1]] = slot

    def _load_everything(self, progress: Callable[[int], None] | None) -> None:
        """Resident case: every unit into its slot, streaming one unit at a time."""
        for layer in self.layers:
            for e in range(self.num_experts):
                slot = self.cache.place((layer, e))
                self.loader.load((layer, e), slot, self._pool[slot])
                if progress is not None:
                    progress(self.source.stored_nbytes)
        if self.copier is not None:
            for slot in range(self.capacity):
                self.copier.before_use(slot)
        check_loaded_units(self.source, self.cache.slot_map(), self._pool)  # NaN/inf in an expert: refused at load
