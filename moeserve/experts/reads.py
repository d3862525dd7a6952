"""The demand misses of one chunk, read while the compute thread works on the experts already in.

The store gives each miss its slot first (`SlotCache.take_miss_slot`, under its lock); `MissReader.start` then
reads them. With I/O threads, every miss but the one the caller needs first is queued at once (the disk serves
several requests at a time) and that first one is read on the compute thread, with no hand-off; `wait` takes back
a read no I/O thread has started yet, so the compute thread never idles while its own miss waits in a queue.
Without I/O threads the compute thread reads them all, in order, before the chunk is used. A failed read gives its
slot back (`abandon_read`: nothing maps to the garbage in it) and raises ExpertLoadError.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from moeserve.errors import ExpertLoadError
from moeserve.experts.slot_cache import Key, SlotCache

# read(key, slot): fill `slot` with `key`'s unit (no lock held); returns (bytes read, served by the host tier).
# Raises what the tiers raise.
ReadUnit = Callable[[Key, int], tuple[int, bool]]


@dataclass(eq=False)
class Read:
    """A demand miss being read: its key, the slot it fills, and its task on an I/O thread (None: not queued)."""

    key: Key
    slot: int
    future: Future[None] | None = None

    @property
    def landed(self) -> bool:
        return self.future is not None and self.future.done()


class MissReader:
    """Reads demand misses into their slots of `cache` (guarded by `cond`) with `read`, on `io_threads` threads
    and the calling one."""

    def __init__(self, cond: threading.Condition, cache: SlotCache, read: ReadUnit, io_threads: int) -> None:
        self._cond = cond
        self._cache = cache
        self._read = read
        self._io = ThreadPoolExecutor(io_threads, thread_name_prefix="moeserve-io") if io_threads > 0 else None
        self.io_threads = io_threads if self._io is not None else 0

    def start(self, keys: list[Key], slots: dict[Key, int]) -> dict[Key, Read]:
        """Read the misses `slots` (key -> its slot, in `keys` order) of the chunk `keys`; the reads in flight.
        Without I/O threads every read is done when this returns (the first failure raises, the later misses
        are abandoned)."""
        reads = {key: Read(key, slot) for key, slot in slots.items()}
        if self._io is None:
            todo = list(reads.values())
            try:
                while todo:
                    self.wait(todo[0])
                    todo.pop(0)
            except BaseException:
                with self._cond:
                    for later in todo[1:]:  # todo[0] failed and gave its slot back itself
                        self._cache.abandon_read(later.key)
                    self._cond.notify_all()
                raise
            return {}
        for n, read in enumerate(reads.values()):
            if n > 0 or read.key != keys[0]:  # the caller's first expert is read by the caller
                read.future = self._io.submit(self._fill, read.key, read.slot)
        return reads

    def wait(self, read: Read) -> None:
        """Block until `read` has landed (raising its ExpertLoadError); one not started yet is done right here."""
        t0 = time.perf_counter()
        try:
            if read.future is None or read.future.cancel():
                read.future = None
                self._fill(read.key, read.slot)
            else:
                read.future.result()
        finally:
            self._cache.stats.wait_seconds += time.perf_counter() - t0

    def settle(self, pending: dict[Key, Read]) -> None:
        """Let every read of `pending` land or fail (the caller stopped early, or another read failed)."""
        for read in pending.values():
            try:
                self.wait(read)
            except ExpertLoadError:
                pass

    def submit(self, fn: Callable[[Key, int], None], key: Key, slot: int) -> Future[None]:
        """Run `fn(key, slot)` on an I/O thread (there must be some): e.g. a bypass read (experts/bypass.py)."""
        assert self._io is not None
        return self._io.submit(fn, key, slot)

    def close(self) -> None:
        if self._io is not None:
            self._io.shutdown(wait=True)

    def _fill(self, key: Key, slot: int) -> None:
        """Fill `slot` (taken for the demand miss `key`) and publish it."""
        t0 = time.perf_counter()
        try:
            nbytes, from_host = self._read(key, slot)
        except Exception as err:
            with self._cond:
                self._cache.abandon_read(key)
                self._cache.stats.load_errors += 1
                self._cond.notify_all()
            detail = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise ExpertLoadError(f"loading expert {key[1]} of layer {key[0]} failed: {detail}") from err
        with self._cond:
            self._cache.stats.read_seconds += time.perf_counter() - t0
            self._cache.finish_read(key, nbytes, from_host=from_host)
            self._cond.notify_all()
