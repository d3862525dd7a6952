"""ExpertStore: the only owner of expert weights. The MoE layer asks it for exactly the experts it needs.

    for chunk in store.experts(layer, expert_ids):      # expert_ids ascending, unique
        for expert_id, weights in chunk:                 # weights: typed views of the unit's fields
            ...

The store keeps a pool of `capacity` slots in the fast tier, each one ExpertUnit. A needed expert that is cached
is a hit; otherwise it is loaded from a slower tier (see `tiers.Loader`) into a free slot or the slot of a victim
chosen by the eviction policy. Experts of the chunk being computed are pinned: never evicted under it. When a layer
needs more experts than there are slots, they come in several chunks, in ascending expert order, so the MoE layer
adds their outputs in the same order as when everything is resident: placement never changes a bit of the result.

"Everything resident" is the case capacity >= number of experts: all units are loaded at start-up and every
access is a hit. There is no second code path.

Threads: the compute thread calls `experts`; a `Prefetcher` thread may load predicted experts meanwhile. One
condition variable guards the maps, the policy and the statistics. A slot being filled belongs to its loader
alone (it is in `_loading`, neither free nor mapped), so no thread ever reads a half-written unit. The policy is
driven exactly as `moeserve.bench.simulate` models it (begin_layer per chunk, hits before misses).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from moeserve.checkpoint.finite import check_loaded_units
from moeserve.checkpoint.safetensors_file import DIRECT_ALIGN
from moeserve.errors import ExpertLoadError, MoeserveError
from moeserve.experts.affinity import AffinityPredictor
from moeserve.experts.policies import DeferredHits, NoVictimError, make_policy
from moeserve.experts.tiers import HostTier, Loader, Tier
from moeserve.experts.transfer import CudaOps, DeviceOps, HostToDevice
from moeserve.experts.unit import ExpertSource
from moeserve.experts.verify import ReferenceScan
from moeserve.memory.hugepages import huge_page_bytes, thp_mode

log = logging.getLogger("moeserve")

Key = tuple[int, int]  # (layer, expert)
ExpertWeights = tuple[torch.Tensor, ...]  # views of one unit's fields, in layout order


@dataclass
class LayerStats:
    hits: int = 0
    misses: int = 0
    bytes_from_disk: int = 0
    bytes_from_host: int = 0
    prefetched: int = 0  # units loaded ahead of a predicted use (their bytes are in bytes_from_*)
    prefetch_used: int = 0  # prefetched units that were needed before being evicted

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
    rows.append(f"hit rate {100 * stats.hit_rate:.1f}%, prefetch accuracy "
                f"{'n/a' if accuracy is None else f'{100 * accuracy:.1f}%'}, load errors {stats.load_errors}, "
                f"compute thread waited {stats.wait_seconds:.2f} s on reads ({stats.read_seconds:.2f} s reading)")
    return "\n".join(rows)


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
    # What prefetch loads: "affinity" = the experts the store's own AffinityPredictor (learned online from the
    # layers' accesses, moeserve/experts/affinity.py) gives at least `prefetch_min_prob` chance of being used by
    # the next layer; "hint" = the guess the caller passes to `experts(..., prefetch=)`.
    prefetch_predictor: str = "affinity"
    prefetch_min_prob: float = 0.5


PROBE_EVERY = 8  # with the prefetch read gate shut, the predictor guesses on one layer call in this many
PROBE_AFTER = 64  # ... once this many first uncached guesses were scored (before that it always guesses)


class _ReadCalibration:
    """How often a guess that is NOT cached gets used, per position among a guess's uncached experts: the chance
    that prefetching it pays its read. The predictor's own calibration covers every guess, and the likely ones are
    mostly cached already; the uncached rest can be far less likely (large bench model: 1 in 5 of the uncached
    top-4 guesses used, where the top 4 hold 82% of the next layer's experts). Every guess is scored when its layer
    runs, read or not, so the estimate keeps learning while prefetch reads nothing."""

    def __init__(self, num_experts: int) -> None:
        self._guesses = [0] * num_experts  # per position: uncached guesses scored
        self._used = [0] * num_experts  # per position: those the layer then used
        self._pending: dict[int, list[int]] = {}  # layer -> its uncached guesses, not scored yet

    def chance(self, position: int) -> float:
        return (self._used[position] + 1) / (self._guesses[position] + 2)

    def scored(self, position: int) -> int:
        """Uncached guesses at `position` scored so far."""
        return self._guesses[position]

    def keep(self, layer: int, uncached: list[int], min_prob: float) -> list[int]:
        """The leading uncached guesses (most likely first) whose position has been used >= `min_prob` of the
        time; remembers all of them to score when `layer` runs."""
        self._pending[layer] = uncached
        n = 0
        while n < len(uncached) and self.chance(n) >= min_prob:
            n += 1
        return uncached[:n]

    def check(self, layer: int, used: Collection[int]) -> None:
        guessed = self._pending.pop(layer, None)
        if guessed:
            needed = set(used)
            for position, e in enumerate(guessed):
                self._guesses[position] += 1
                self._used[position] += e in needed


@dataclass(eq=False)
class _Read:
    """A demand miss being read: its key, the slot it fills, and its task on an I/O thread (None: not queued)."""

    key: Key
    slot: int
    future: Future[None] | None = None

    @property
    def landed(self) -> bool:
        return self.future is not None and self.future.done()


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
        self.source = source
        self.layout = source.layout
        self.layers = list(layers)
        self.num_experts = num_experts
        self.total_experts = len(self.layers) * num_experts
        self.capacity = max(1, min(capacity, self.total_experts))
        self.device = device
        self.resident = self.capacity >= self.total_experts
        self.stats = StoreStats()
        for layer in self.layers:  # every entry exists up front: readers on other threads never see the dict grow
            self.stats.layer(layer)
        self._cond = threading.Condition()
        # [capacity, unit_nbytes] uint8: one row per slot. Views per slot are built once (nothing per call).
        # On CPU every decode step streams these: 2 MiB pages where the kernel allows (moeserve.memory.hugepages).
        self.huge_pages = False
        if device.type == "cpu":
            flat, self.huge_pages = huge_page_bytes(self.capacity * self.layout.nbytes)
            self._pool = flat.view(self.capacity, self.layout.nbytes)
        else:
            self._pool = torch.empty(self.capacity, self.layout.nbytes, dtype=torch.uint8, device=device)
        self._slot_views: list[ExpertWeights] = [self.layout.views(self._pool[s]) for s in range(self.capacity)]
        self._slot_of: dict[Key, int] = {}  # units ready in a slot
        # The same map as a table for C++ (the DecodeStack runs layers whose experts are all cached without asking,
        # see cached_calls): slot_table[i, e] = the slot of expert e of self.layers[i], -1 if not ready. Written
        # through the numpy view (~100 ns a write) wherever _slot_of changes: _publish and _unpublish.
        self.slot_table = torch.full((len(self.layers), num_experts), -1, dtype=torch.int32)
        self._slot_rows = self.slot_table.numpy()
        self._row_of = {layer: i for i, layer in enumerate(self.layers)}
        self._loading: dict[Key, int] = {}  # units being written into a slot (by either thread)
        self._free_slots = list(range(self.capacity - 1, -1, -1))
        self._pinned: set[Key] = set()  # the compute thread's current chunk
        self._prefetch_unused: set[Key] = set()
        ops = opts.ops if opts.ops is not None else (CudaOps(device) if device.type == "cuda" else None)
        self.copier = HostToDevice(ops, self.capacity, self.layout.nbytes) if ops is not None else None
        host = None
        if opts.host_capacity > 0 and not self.resident:
            host = HostTier(min(opts.host_capacity, self.total_experts), self.layout.nbytes, self.copier)
        self.loader = Loader(source, device, self.copier, host, verify=not self.resident)
        self._io: ThreadPoolExecutor | None = None
        if not self.resident and opts.io_threads > 0:
            self._io = ThreadPoolExecutor(opts.io_threads, thread_name_prefix="moeserve-io")
        self.io_threads = opts.io_threads if self._io is not None else 0
        self.policy = None
        self.prefetcher = None
        self.predictor: AffinityPredictor | None = None  # prefetch guesses from this store's own history
        self.prefetch_min_prob = opts.prefetch_min_prob
        self._reads_worth = _ReadCalibration(num_experts)
        self._calls = 0  # layer calls that could guess a next layer (see PROBE_EVERY)
        self._next_layer = dict(zip(self.layers, self.layers[1:]))
        self.source_note: str | None = None
        self.reference_scan: ReferenceScan | None = None  # start_reference_scan
        if self.resident:
            self._load_everything(progress)
        else:
            prepare = getattr(source, "prepare_offload", None)  # test fakes may lack it
            self.source_note = prepare() if prepare is not None else None
            known = getattr(source, "known_checksums", None)  # a spill file's header (test fakes may lack it)
            if known is not None and self.loader.verifier is not None:
                checksum_name, checksums = known()
                if checksums:
                    self.loader.verifier.seed(checksums, checksum_name)
            # Hits are told to the policy in batches (DeferredHits: the same calls, the same choices, warm caches).
            self.policy = DeferredHits(make_policy(opts.policy, **opts.policy_options))
            if opts.prefetch:
                from moeserve.experts.prefetch import Prefetcher

                self.prefetcher = Prefetcher(self)
                if opts.prefetch_predictor == "affinity":
                    self.predictor = AffinityPredictor(num_experts)
                elif opts.prefetch_predictor != "hint":
                    raise MoeserveError(f"unknown prefetch_predictor {opts.prefetch_predictor!r} (affinity, hint)")

    # ------------------------------------------------------------------------------------------- public
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
            pinned = "pinned" if self.loader.host.pinned else "pageable"
            parts.append(f"host tier {self.loader.host.capacity} experts ({self.host_nbytes / 2**20:.1f} MiB, "
                         f"{pinned})")
        if self.copier is not None:
            parts.append(f"transfers: {self.copier.mode.reason}")
        if self.resident:
            parts.append("all experts resident")
        else:
            assert self.policy is not None
            how = "off"
            if self.prefetcher is not None:
                how = (f"on (experts the affinity predictor learned online gives >= {self.prefetch_min_prob:.0%} "
                       "chance in the next layer, read only while such guesses not in the cache were used as often)"
                       if self.predictor is not None else "on (the caller's guesses)")
            parts.append(f"policy {self.policy.name}, prefetch {how}")
            if self.source_note:
                parts.append(self.source_note)
            parts.append(f"misses read by {self.io_threads} I/O threads + the compute thread, overlapped with "
                         "the compute of experts already in" if self.io_threads else
                         "misses read by the compute thread in turn")
            parts.append(f"{'O_DIRECT' if self._direct_reads() else 'page-cache'} reads, read buffers up to "
                         f"{self.staging_nbytes / 2**20:.1f} MiB")
        return "; ".join(parts)

    def experts(self, layer: int, expert_ids: Sequence[int],
                prefetch: tuple[int, Sequence[int]] | None = None) -> Iterator[list[tuple[int, ExpertWeights]]]:
        """Yield the needed experts in chunks that fit the cache, ascending by expert id.

        Each chunk's experts are pinned until the next chunk is requested (or the generator ends).
        `prefetch` = (next layer, predicted expert ids, most likely first): once this layer's experts are in,
        the prefetcher starts loading them (only when this layer fits in one chunk, so it cannot evict any of
        this layer's experts). A load failure raises ExpertLoadError; the store stays consistent.
        """
        if self.resident:
            with self._cond:
                self.stats.layer(layer).hits += len(expert_ids)
            yield [(e, self._slot_views[self._slot_of[(layer, e)]]) for e in expert_ids]
            return
        if self.prefetcher is None and len(expert_ids) <= self.capacity:
            # Decode's common case, every expert cached: the general path below, minus its machinery for misses
            # and prefetch (same policy calls, same pins and statistics). Each call runs right after a layer's
            # compute has streamed tens of MB through the CPU caches, so every line of Python here is a cache miss.
            pinned = self._pin_if_all_cached(layer, expert_ids)
            if pinned is not None:
                keys, slots = pinned
                try:
                    yield from self._lend(expert_ids, slots)
                finally:
                    with self._cond:
                        self._pinned.difference_update(keys)
                return
        ids = list(expert_ids)
        chunks = [ids[i : i + self.capacity] for i in range(0, len(ids), self.capacity)]
        if self.predictor is not None:  # the store's own guess replaces the caller's
            self.predictor.observe(layer, ids)
            self._reads_worth.check(layer, ids)
            nxt = self._next_layer.get(layer)
            # Once guesses not in the cache have proved not worth reading (the gate below shut after PROBE_AFTER
            # of them were scored), guess only every PROBE_EVERY-th layer call, enough to notice when they become
            # worth it: the guessing is Python at every layer with the caches cold (~1.5 ms of a 22 ms token on
            # the large bench model, where the gate stays shut).
            self._calls += nxt is not None
            rw = self._reads_worth
            probe = (rw.chance(0) >= self.prefetch_min_prob or rw.scored(0) < PROBE_AFTER
                     or self._calls % PROBE_EVERY == 0)
            guess = [] if nxt is None or not probe else self.predictor.predict(nxt, len(ids), self.prefetch_min_prob)
            if guess and nxt is not None:
                with self._cond:
                    uncached = [e for e in guess if (nxt, e) not in self._slot_of and (nxt, e) not in self._loading]
                guess = self._reads_worth.keep(nxt, uncached, self.prefetch_min_prob)
            prefetch = (nxt, guess) if guess and nxt is not None else None
        for chunk in chunks:
            keys = [(layer, e) for e in chunk]
            pending = self._acquire(layer, keys)  # key -> its read in flight (the misses)
            try:
                if prefetch is not None and len(chunks) == 1 and self.prefetcher is not None:
                    self.prefetcher.submit(prefetch[0], prefetch[1], protect=keys)
                # Yield the chunk in ascending runs of experts that are in, so the caller computes them while
                # the misses after them are still being read; the order of experts never changes.
                i = 0
                while i < len(keys):
                    if keys[i] in pending:
                        self._wait_read(pending.pop(keys[i]))
                    j = i + 1
                    while j < len(keys) and (keys[j] not in pending or pending[keys[j]].landed):
                        if keys[j] in pending:
                            self._wait_read(pending.pop(keys[j]))  # done: re-raises its error, if any
                        j += 1
                    with self._cond:
                        slots = [self._slot_of[k] for k in keys[i:j]]
                    yield from self._lend(chunk[i:j], slots)
                    i = j
            finally:
                for read in pending.values():  # the caller stopped early or a read failed: let the others land
                    try:
                        self._wait_read(read)
                    except ExpertLoadError:
                        pass
                with self._cond:
                    self._pinned.difference_update(keys)

    @property
    def calls_may_skip(self) -> bool:
        """Whether a caller may compute a layer whose experts are all ready in `slot_table` without asking
        `experts`, then report it with `cached_calls`: offloaded, on CPU, and nothing evicts behind the caller's back
        (no prefetch thread; a call's demand reads have all landed when it returns)."""
        return not self.resident and self.prefetcher is None and self.device.type == "cpu"

    def slot_units(self) -> list[ExpertWeights]:
        """The views of every slot of the fast tier, by slot (fixed for the store's life; see `slot_table`)."""
        return list(self._slot_views)

    def cached_calls(self, log: Sequence[int]) -> None:
        """Layer calls a caller ran on units ready in `slot_table` (`calls_may_skip`), in order, flat: (index in
        self.layers, count, expert ids...) each. Counted and told to the policy as `experts` does for an all-hit call."""
        with self._cond:
            i = 0
            while i < len(log):
                layer, n = self.layers[log[i]], log[i + 1]
                self._count_all_hit(layer, [(layer, e) for e in log[i + 2 : i + 2 + n]])
                i += 2 + n

    def resident_units(self, layer: int) -> list[ExpertWeights]:
        """Resident store only: the views of every expert of `layer`, by expert id. They never move or get evicted
        (a resident store loads each unit once into its own slot), so a caller may hold them for the process's
        life; it then counts its uses with `count_resident_hits`."""
        if not self.resident:
            raise MoeserveError("resident_units: the store is not resident (experts move between tiers)")
        return [self._slot_views[self._slot_of[(layer, e)]] for e in range(self.num_experts)]

    def count_resident_hits(self, hits_per_layer: Sequence[int]) -> None:
        """Add hits counted outside `experts` (one per needed expert per layer call) for each of `self.layers`."""
        with self._cond:
            for layer, n in zip(self.layers, hits_per_layer):
                self.stats.layers[layer].hits += n

    def prefetch(self, layer: int, expert_ids: Sequence[int]) -> None:
        """A hint that `layer` will soon need `expert_ids` (most likely first). No-op when resident or off."""
        if self.prefetcher is not None:
            self.prefetcher.submit(layer, expert_ids)

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
        return self.source.staging_nbytes + threads * per_thread + scan

    def _direct_reads(self) -> bool:
        return bool(getattr(getattr(self.source.checkpoint, "reader", None), "direct", False))

    def cancel_prefetch(self) -> None:
        """Drop the pending guesses and stop the one being loaded after its current unit (e.g. the step ended:
        a guess for a layer of this step is stale). No-op without prefetch."""
        if self.prefetcher is not None:
            with self._cond:
                self.prefetcher.cancel()

    def cached_keys(self) -> set[Key]:
        """The (layer, expert) units ready in the fast tier now."""
        with self._cond:
            return set(self._slot_of)

    def close(self) -> None:
        if self.reference_scan is not None:
            self.reference_scan.stop()
        if self.prefetcher is not None:
            self.prefetcher.close()
        if self._io is not None:
            self._io.shutdown(wait=True)
        close = getattr(self.source, "close", None)
        if close is not None:
            close()
        self.source.checkpoint.close()

    # ------------------------------------------------------------------------------------------ internals
    def _lend(self, expert_ids: Sequence[int], slots: list[int]) -> Iterator[list[tuple[int, ExpertWeights]]]:
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

    def _pin_if_all_cached(self, layer: int, expert_ids: Sequence[int]) -> tuple[list[Key], list[int]] | None:
        """When every needed unit of `layer` is ready in a slot: pin them, count the hits, tell the policy (as
        `_acquire` does for hits) and return (keys, slots). Otherwise None, with nothing changed."""
        assert self.policy is not None
        keys = [(layer, e) for e in expert_ids]
        with self._cond:
            slot_of = self._slot_of
            slots = [slot_of.get(k, -1) for k in keys]
            if -1 in slots:  # (a unit being loaded is not in _slot_of yet)
                return None
            self._count_all_hit(layer, keys)
            self._pinned.update(keys)
        return keys, slots

    def _count_all_hit(self, layer: int, keys: list[Key]) -> None:
        """(Lock held.) A layer call whose units were all ready: its hits, and the policy told as `_acquire` does."""
        assert self.policy is not None
        self.policy.begin_layer(layer)
        for key in keys:
            self.policy.on_hit(key)
        self.stats.layers[layer].hits += len(keys)

    def _acquire(self, layer: int, keys: list[Key]) -> dict[Key, _Read]:
        """Pin `keys`, wait for any of them in flight, count hits, start reading the misses; the reads started.

        Every miss gets its slot (and its `on_insert`) here, in ascending order as the simulator does; its
        bytes land later, on an I/O thread (or on the compute thread, see `_wait_read`).
        """
        assert self.policy is not None
        reads: dict[Key, _Read] = {}
        with self._cond:
            if self.prefetcher is not None:
                self.prefetcher.cancel()  # any pending guess is for this layer or older: demand loads take over
            self.policy.begin_layer(layer)
            self._pinned.update(keys)
            if any(k in self._loading for k in keys):
                t0 = time.perf_counter()
                while any(k in self._loading for k in keys):
                    self._cond.wait()
                self.stats.wait_seconds += time.perf_counter() - t0
            st = self.stats.layer(layer)
            missing = []
            for key in keys:
                if key in self._slot_of:
                    st.hits += 1
                    self.policy.on_hit(key)
                    if key in self._prefetch_unused:
                        self._prefetch_unused.discard(key)
                        st.prefetch_used += 1
                else:
                    missing.append(key)
            try:
                for key in missing:
                    slot = self._take_slot(key, self._pinned, wait=True)
                    assert slot is not None
                    self.policy.on_insert(key)
                    st.misses += 1
                    reads[key] = _Read(key, slot)
            except BaseException:
                for read in reads.values():
                    self._abandon(read.key, read.slot)
                self._pinned.difference_update(keys)
                raise
        if self._io is None:  # no I/O threads: read every miss now, in order, and yield the chunk whole
            todo = list(reads.values())
            try:
                while todo:
                    t0 = time.perf_counter()
                    self._read_slot(todo[0].key, todo[0].slot)
                    self.stats.wait_seconds += time.perf_counter() - t0
                    todo.pop(0)
            except BaseException:
                with self._cond:
                    for later in todo[1:]:  # todo[0] failed and gave its slot back itself
                        self._abandon(later.key, later.slot)
                    self._pinned.difference_update(keys)
                raise
            return {}
        # The first miss with no expert before it to compute meanwhile is read right here (no thread hand-off);
        # the others go to the I/O threads at once, so the disk has them all queued.
        for n, read in enumerate(reads.values()):
            if n > 0 or read.key != keys[0]:
                read.future = self._io.submit(self._read_slot, read.key, read.slot)
        return reads

    def _wait_read(self, read: _Read) -> None:
        """Block until `read` has landed (raising its ExpertLoadError). A read no I/O thread has started yet is
        taken back and done on this thread: the compute thread never idles while its own miss waits in a queue."""
        t0 = time.perf_counter()
        try:
            if read.future is None or read.future.cancel():
                read.future = None
                self._read_slot(read.key, read.slot)
            else:
                read.future.result()
        finally:
            self.stats.wait_seconds += time.perf_counter() - t0

    def _read_slot(self, key: Key, slot: int) -> None:
        """Fill `slot` (already taken, `key` in `_loading` and inserted in the policy) and publish it."""
        t0 = time.perf_counter()
        try:
            tier = self.loader.load(key, slot, self._pool[slot])
        except Exception as err:
            with self._cond:
                self._abandon(key, slot)
                self.stats.load_errors += 1
            detail = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise ExpertLoadError(f"loading expert {key[1]} of layer {key[0]} failed: {detail}") from err
        with self._cond:
            self.stats.read_seconds += time.perf_counter() - t0
            del self._loading[key]
            self._publish(key, slot)
            self._count_read(key, tier)
            self._cond.notify_all()

    def _publish(self, key: Key, slot: int) -> None:
        """(Lock held, or no other thread yet.) `key`'s unit is ready in `slot`."""
        self._slot_of[key] = slot
        self._slot_rows[self._row_of[key[0]], key[1]] = slot

    def _unpublish(self, key: Key) -> int:
        """(Lock held.) `key`'s unit leaves its slot (evicted); returns the slot."""
        self._slot_rows[self._row_of[key[0]], key[1]] = -1
        return self._slot_of.pop(key)

    def _abandon(self, key: Key, slot: int) -> None:
        """(Lock held.) A demand read that will not land: the slot holds garbage and maps to nothing."""
        assert self.policy is not None
        if self._loading.pop(key, None) is not None:
            self._free_slots.append(slot)
            self.policy.on_evict(key)
        self._cond.notify_all()

    def _count_read(self, key: Key, tier: Tier) -> None:
        st = self.stats.layer(key[0])
        if tier is Tier.HOST:
            st.bytes_from_host += self.layout.nbytes
        else:
            st.bytes_from_disk += self.source.stored_nbytes

    def _take_slot(self, key: Key, pinned: Collection[Key], wait: bool) -> int | None:
        """(Lock held.) A slot for `key`, marked loading: free, or an evicted unpinned victim's.

        When every cached unit is pinned, wait for in-flight loads to land (compute thread) or give up (None).
        """
        assert self.policy is not None
        while True:
            if self._free_slots:
                slot = self._free_slots.pop()
                break
            try:
                victim = self.policy.choose_victim(pinned)
            except NoVictimError:
                if not wait or all(k in pinned for k in self._loading):  # only loads that free nothing
                    if wait:
                        raise MoeserveError("expert cache: no evictable slot although nothing is loading; "
                                            "this is a bug in the store") from None
                    return None
                self._cond.wait()  # slots held by prefetches in flight: they become evictable when done
                continue
            slot = self._unpublish(victim)
            self.policy.on_evict(victim)
            self._prefetch_unused.discard(victim)
            break
        self._loading[key] = slot
        return slot

    def _load(self, key: Key, prefetched: bool, protect: Collection[Key] = (),
              wanted: Callable[[], bool] | None = None) -> bool:
        """Load `key` into a slot on the prefetch thread (False when it found no room or is no longer `wanted`).
        Victims are never pinned by the compute thread, being loaded, nor in `protect`."""
        assert prefetched, "demand misses are read through _acquire"
        with self._cond:
            if wanted is not None and not wanted():
                return False
            pinned = self._pinned | set(protect) | set(self._loading)
            slot = self._take_slot(key, pinned, wait=False)
            if slot is None:
                return False
        try:
            tier = self.loader.load(key, slot, self._pool[slot])
        except Exception:
            with self._cond:
                del self._loading[key]
                self._free_slots.append(slot)  # the slot holds garbage now: nothing maps to it
                self.stats.load_errors += 1
                self._cond.notify_all()
            raise
        with self._cond:
            del self._loading[key]
            self._publish(key, slot)
            assert self.policy is not None
            self.policy.on_insert(key, prefetched=True)
            self._count_read(key, tier)
            st = self.stats.layer(key[0])
            st.prefetched += 1
            self._prefetch_unused.add(key)
            self._cond.notify_all()
        return True

    def _load_everything(self, progress: Callable[[int], None] | None) -> None:
        """Resident case: every unit into its slot, streaming one unit at a time."""
        for layer in self.layers:
            for e in range(self.num_experts):
                slot = self._free_slots.pop()
                self.loader.load((layer, e), slot, self._pool[slot])
                self._publish((layer, e), slot)
                if progress is not None:
                    progress(self.source.stored_nbytes)
        if self.copier is not None:
            for slot in range(self.capacity):
                self.copier.before_use(slot)
        check_loaded_units(self.source, self._slot_of, self._pool)  # NaN/inf in an expert: refused at load


def static_policy_options(trace_path: str, capacity: int) -> dict[str, Any]:
    """Options of the `static` policy from a recorded routing trace: pin the most used experts, leaving enough
    slots to LRU for the largest set one layer call needed (as the cache simulator does)."""
    from moeserve.bench.simulate import calls_from_steps, static_reserve, usage_counts
    from moeserve.experts.trace import read_trace

    calls = calls_from_steps(read_trace(trace_path))
    return {"counts": usage_counts(calls), "num_pinned": max(0, capacity - static_reserve(calls))}
