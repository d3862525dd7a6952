"""The expert store on an asynchronous fake fast tier (tests/experts/async_device.py): no wrong data, and every
wait the store makes is needed.

The real store, loader, host tier and copier run unchanged with `StoreOptions(ops=AsyncFakeOps(...))`. A fake
model asks the store for experts layer by layer and launches one "kernel" per expert on the fake compute stream;
the kernel compares the slot's bytes with the source's when the stream reaches it (late). Copies read their source
late too, so a wait the store leaves out shows up as a slot holding another unit's bytes, or none.

Each configuration (host-tier eviction, prefetch, a pageable host tier beside a pinned staging buffer, no pinning
at all, everything resident) runs under three timings: both streams with random delays; copies late (run only when
something waits for them: a missing wait before a kernel or before a buffer is refilled always bites); kernels
late (a missing wait before a slot is overwritten always bites), each for two seeds x 240 layer calls.

Waits checked by removal (each test_removing_* monkeypatches one out and sees wrong data):
1. `HostToDevice.before_use`: the compute stream waits for the copy into a slot before kernels read it;
2. `HostToDevice.copy_in`'s `side_wait`: the copy stream waits for the kernels that read a slot's old unit before
   overwriting it (asynchronous and synchronous copies alike);
3. `HostToDevice.after_use`: the event those kernels are waited by (without it, wait 2 waits for nothing);
4. `HostToDevice.wait_source_free`: the host waits for the copy out of a pinned buffer (the staging buffer, a
   host-tier slot) before reading the next unit into it;
5. `ExpertStore._load_everything`'s `before_use` of every slot: a resident store's kernels wait for its loads.
Also checked, ownership rather than waits (the loader holds no lock across a read or a copy):
6. `Loader._take_buffer`: each of the two staging buffers is used by one load at a time (a load waits, asleep,
   for one to come back); handing every load the same buffer gives wrong data or a unit that changes under the
   verifier's read;
7. the busy mark on host-tier slots (`HostTier.reserve(key, busy=...)`): a host slot a load is reading into or
   copying from is never another load's victim; without it, with fewer host slots than loads at once
   ("small-host"), a busy slot is refilled under its load.
Not checkable here: the `synchronize` after a synchronous copy in `copy_in` (torch's blocking `copy_` already
waits for it on CUDA, and the fake does the same, so removing it changes nothing on either).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import pytest
import torch

from moeserve.errors import ExpertLoadError
from moeserve.experts.store import ExpertStore, StoreOptions
from moeserve.experts.tiers import HostTier, Loader
from moeserve.experts.transfer import HostToDevice
from moeserve.experts.unit import ExpertSource, UnitLayout
from tests.experts.async_device import AsyncFakeOps, Timing
from tests.experts.test_store import FakeCheckpoint

LAYERS = (0, 1, 2, 3)
NUM_EXPERTS = 8
UNIT_BYTES = 1024
STEPS = 60  # x 4 layers = 240 layer calls per run


_RUNS = itertools.count()


class PatternSource(ExpertSource):
    """Unit (layer, expert) = UNIT_BYTES random bytes drawn from (seed, this source's run number): every unit
    differs, and from those of every other run in the process, the same seed included (a new slot pool may sit in
    a freed one's memory: with the same bytes there, a missing wait would read stale but equal bytes and pass)."""

    def __init__(self, seed: int) -> None:
        super().__init__(FakeCheckpoint(), UnitLayout.build([("w", torch.uint8, (UNIT_BYTES,))]), {})  # type: ignore[arg-type]
        gen = torch.Generator().manual_seed(seed * 1_000_003 + next(_RUNS))
        self.units = {(layer, e): torch.randint(0, 256, (UNIT_BYTES,), dtype=torch.uint8, generator=gen)
                      for layer in LAYERS for e in range(NUM_EXPERTS)}
        self.disk_reads = 0

    @property
    def stored_nbytes(self) -> int:
        return UNIT_BYTES

    def unit_files(self, layer: int, expert: int) -> str:
        return "the pattern source"

    def read_unit(self, layer: int, expert: int, unit_bytes: torch.Tensor) -> None:
        self.disk_reads += 1  # under the loader's lock (staged reads)
        unit_bytes.copy_(self.units[(layer, expert)])


@dataclass(frozen=True)
class Config:
    name: str
    capacity: int  # fast-tier slots, of 32 units
    host_capacity: int = 0
    prefetch: bool = False  # the caller's hints: the next call's experts and one wrong guess
    pin_limit_bytes: int | None = None  # None: pinning always works; 0: never


CONFIGS = {c.name: c for c in [
    Config("host-eviction", capacity=5, host_capacity=12),
    Config("prefetch", capacity=8, prefetch=True),
    Config("prefetch-host", capacity=6, host_capacity=10, prefetch=True),
    Config("pinned-staging-pageable-host", capacity=5, host_capacity=12, pin_limit_bytes=UNIT_BYTES),
    Config("no-pinning", capacity=5, host_capacity=12, pin_limit_bytes=0),
    Config("resident", capacity=32),
    # fewer host slots than loads at once (I/O threads, compute thread, prefetcher): loads find them all busy
    Config("small-host", capacity=5, host_capacity=2, prefetch=True),  # as many host slots as loads at once
]}
TIMINGS: dict[str, tuple[Timing, Timing]] = {  # (copies, kernels)
    "random": ("random", "random"),
    "late-copies": ("late", "random"),
    "late-kernels": ("random", "late"),
}


@dataclass
class Outcome:
    store: ExpertStore
    ops: AsyncFakeOps
    source: PatternSource
    wrong: list[tuple[int, int, int]] = field(default_factory=list)  # (step, layer, expert) read wrong bytes
    launched: int = 0
    checked: int = 0
    host_pinned: bool | None = None  # the host tier's, read before close() frees it

    def check(self, unit: torch.Tensor, expected: torch.Tensor, where: tuple[int, int, int]) -> None:
        """A kernel: runs on the compute stream, reads the slot when it runs."""
        self.checked += 1  # the compute stream runs one kernel at a time
        if not torch.equal(unit, expected):
            self.wrong.append(where)


def choose_experts(rng: random.Random, step: int) -> list[int]:
    """The experts one layer call needs: all of them in the first step (more than most caches hold: chunks),
    then 1-4, sometimes 7, drawn with a skew so that some are hits."""
    if step == 0:
        return list(range(NUM_EXPERTS))
    k = rng.choice([1, 2, 2, 3, 4, 7])
    return sorted(set(rng.choices(range(NUM_EXPERTS), weights=[8, 6, 4, 3, 2, 1, 1, 1], k=k)))


def run(config: Config, timing: str, seed: int, steps: int = STEPS) -> Outcome:
    """`steps` forward passes of the fake model over every layer; the compute stream synchronized at the end of
    about half of them (a step's logits read back), and always at the end."""
    copies, kernels = TIMINGS[timing]
    ops = AsyncFakeOps(seed, copies, kernels, pin_limit_bytes=config.pin_limit_bytes)
    source = PatternSource(seed)
    opts = StoreOptions(policy="lru", host_capacity=config.host_capacity, prefetch=config.prefetch,
                        prefetch_predictor="hint", ops=ops)
    store = ExpertStore(source, LAYERS, NUM_EXPERTS, config.capacity, torch.device("cpu"), options=opts)
    out = Outcome(store, ops, source)
    rng = random.Random(seed)
    try:
        for step in range(steps):
            calls = [(layer, choose_experts(rng, step)) for layer in LAYERS]
            for i, (layer, ids) in enumerate(calls):
                hint = None
                if i + 1 < len(calls):
                    hint = (calls[i + 1][0], calls[i + 1][1] + [rng.randrange(NUM_EXPERTS)])
                for chunk in store.experts(layer, ids, prefetch=hint):
                    for e, (unit,) in chunk:
                        ops.launch(partial(out.check, unit, source.units[(layer, e)], (step, layer, e)))
                        out.launched += 1
            store.cancel_prefetch()
            if rng.random() < 0.5:
                ops.synchronize_compute()
        ops.synchronize_compute()
        out.host_pinned = store.loader.host.pinned if store.loader.host is not None else None
    finally:
        store.close()
        ops.close()
    return out


def assert_exercised(config: Config, out: Outcome) -> None:
    """The run did what its configuration is named for."""
    store, ops, stats = out.store, out.ops, out.store.stats
    assert out.launched > 500 and out.checked == out.launched
    assert store.copier is not None
    if config.host_capacity:
        host = store.loader.host
        assert host is not None and host.evictions > 0
        assert stats.bytes_from_host > 0 or host.capacity < config.capacity
        assert out.source.disk_reads > host.capacity  # host slots were taken from units in them: evictions
        assert out.host_pinned == (config.pin_limit_bytes is None)
    if config.prefetch:
        assert stats.prefetched > 0 and stats.prefetch_used > 0
    if config.pin_limit_bytes is None:
        assert ops.async_copies > 0
    elif config.pin_limit_bytes > 0:  # pinned staging, pageable host tier: asynchronous mode, blocking copies
        assert store.copier.mode.asynchronous and ops.async_copies == 0 and ops.sync_copies > 0
    else:
        assert not store.copier.mode.asynchronous and ops.async_copies == 0
    if config.name == "resident":
        assert store.resident and stats.misses == 0
    else:
        assert stats.misses > 0 and stats.hits > 0


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("timing", list(TIMINGS))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_no_wrong_data(name, timing, seed):
    config = CONFIGS[name]
    out = run(config, timing, seed)
    assert out.ops.errors == [] and out.ops.violations == []
    assert out.wrong == [], f"{len(out.wrong)} of {out.launched} kernels read another unit's bytes"
    assert_exercised(config, out)


# --------------------------------------------------------------------------------------- waits removed
def assert_wrong_data(runs: list[tuple[str, str]], seeds: tuple[int, ...] = (0, 1)) -> None:
    """Every (config, timing) of `runs` under every seed reads wrong bytes somewhere."""
    for name, timing in runs:
        for seed in seeds:
            out = run(CONFIGS[name], timing, seed, steps=20)
            assert out.wrong, f"{name}, {timing}, seed {seed}: no wrong data without the wait"


def before_use_without_wait(self: HostToDevice, slot: int) -> None:
    with self._lock:
        self._filled[slot] = None  # the copy's event, dropped without the compute stream waiting for it


def test_removing_the_compute_wait_before_kernels_read_a_slot(monkeypatch):
    monkeypatch.setattr(HostToDevice, "before_use", before_use_without_wait)
    assert_wrong_data([("host-eviction", "late-copies"), ("prefetch", "late-copies"),
                       ("resident", "late-copies")])


def test_removing_the_copy_streams_wait_for_a_slots_readers(monkeypatch):
    copy_in = HostToDevice.copy_in

    def copy_in_without_side_wait(self: HostToDevice, slot: int, dst: torch.Tensor, src: torch.Tensor,
                                  src_pinned: bool) -> None:
        with self._lock:
            self._read[slot] = None  # the readers' event: copy_in finds none to wait for
        copy_in(self, slot, dst, src, src_pinned)

    monkeypatch.setattr(HostToDevice, "copy_in", copy_in_without_side_wait)
    assert_wrong_data([("host-eviction", "late-kernels"), ("prefetch", "late-kernels"),
                       ("pinned-staging-pageable-host", "late-kernels"), ("no-pinning", "late-kernels")])


def test_removing_the_readers_event_after_use(monkeypatch):
    monkeypatch.setattr(HostToDevice, "after_use", lambda self, slots: None)
    assert_wrong_data([("host-eviction", "late-kernels"), ("no-pinning", "late-kernels")])


def test_removing_the_host_wait_before_a_pinned_buffer_is_refilled(monkeypatch):
    monkeypatch.setattr(HostToDevice, "wait_source_free", lambda self, src: None)
    assert_wrong_data([("host-eviction", "late-copies"), ("prefetch", "late-copies"), ("resident", "random")])


@contextmanager
def patched(owner: type, name: str, value: Callable[..., None]) -> Iterator[None]:
    saved = owner.__dict__[name]
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def test_removing_the_resident_stores_wait_for_its_loads(monkeypatch):
    # Only while the store is built: `_load_everything`'s loop over every slot does nothing.
    init = ExpertStore.__init__

    def init_without_load_waits(self: ExpertStore, *args, **kwargs) -> None:
        with patched(HostToDevice, "before_use", before_use_without_wait):
            init(self, *args, **kwargs)

    monkeypatch.setattr(ExpertStore, "__init__", init_without_load_waits)
    assert_wrong_data([("resident", "late-copies")])


def collides(name: str, seeds: tuple[int, ...] = (0, 1, 2)) -> bool:
    """Some run of `name` read wrong bytes, or had the verifier see a unit change under its read."""
    for seed in seeds:
        try:
            if run(CONFIGS[name], "random", seed).wrong:
                return True
        except ExpertLoadError as err:
            if "differ from those read before" in str(err):
                return True
    return False


def test_removing_the_staging_buffers_checkout(monkeypatch):
    # Every load reads into the first staging buffer, whether another load is reading into it or copying out of it
    # (what one staging buffer shared without a lock is): the readers (I/O threads, compute thread, prefetcher)
    # overwrite each other's units.
    monkeypatch.setattr(Loader, "_take_buffer", lambda self: self.copier.staging[0])
    assert collides("prefetch"), "the readers of a staging buffer never collided without the checkout"


def test_removing_the_busy_mark_on_host_slots(monkeypatch):
    # A host slot being read into, or copied from, may then be chosen as another load's victim and refilled.
    reserve = HostTier.reserve
    monkeypatch.setattr(HostTier, "reserve", lambda self, key, busy=(): reserve(self, key))
    assert collides("small-host"), "no load refilled a busy host slot without the mark"


def test_a_caller_may_not_skip_the_store_when_slots_arrive_by_device_copies():
    # calls_may_skip lets the C++ decode stack read ready slots without asking `experts`, so without before_use.
    ops = AsyncFakeOps(0)
    store = ExpertStore(PatternSource(0), LAYERS, NUM_EXPERTS, 5, torch.device("cpu"),
                        options=StoreOptions(ops=ops))
    try:
        assert not store.calls_may_skip
    finally:
        store.close()
        ops.close()
