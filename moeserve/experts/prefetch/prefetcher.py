"""Prefetch: load the experts predicted for the next MoE layer in a background thread, so I/O overlaps compute.

Once a layer's experts are acquired (`after_acquire`), the store's own guesses (experts/prefetch/guess.py) or the caller's
hint name the next layer's likely experts. Those already cached are protected, the others queued here
(`SlotCache.plan_prefetch`). The thread reads them, most likely first, each into a free slot or the slot of a
victim that is neither pinned by the compute thread, nor being loaded, nor protected (the guessing layer's
experts, the guesses: a prefetch never evicts what it predicted), and stops at the first of: the list is done;
no such slot is left; the compute thread has moved on (`cancel`, called when it acquires the next layer: from then
on demand loads are the ones that matter). A wrong guess costs a read and a slot, never correctness: prefetched
units are the same bytes a demand miss would read, and a unit is only visible once fully written.

The prefetcher shares the store's condition variable and `SlotCache`, and reads bytes through the store's `read`
callback; it imports nothing of the store.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from moeserve.experts.prefetch.guess import OnlineGuesses
from moeserve.experts.reads import ReadUnit
from moeserve.experts.slot_cache import Key, SlotCache

log = logging.getLogger("moeserve")

class Prefetcher:
    """One daemon thread per store. Its state, and the cache, are guarded by `cond`, the store's condition."""

    def __init__(self, cond: threading.Condition, cache: SlotCache, read: ReadUnit, layers: Sequence[int],
                 guesses: OnlineGuesses | None) -> None:
        """`guesses`: the store's own (None: the caller's hints)."""
        self._cond = cond
        self._cache = cache
        self._read = read
        self.guesses = guesses
        self._next_layer = dict(zip(layers, layers[1:]))
        self._request: tuple[list[Key], int] | None = None  # (keys, epoch)
        self._epoch = 0  # bumped by cancel(): a running request of an older epoch stops
        self._closed = False
        self._busy = False  # a request is being loaded
        self._warned = False
        self._thread: threading.Thread | None = None

    def observe(self, layer: int, expert_ids: Sequence[int]) -> None:
        """(Compute thread, before acquiring.) `layer` routed to `expert_ids`: the store's guesses learn."""
        if self.guesses is not None:
            self.guesses.observe(layer, expert_ids)

    def after_acquire(self, layer: int, keys: list[Key], hint: tuple[int, Sequence[int]] | None) -> None:
        """(Compute thread, lock not held.) `keys`, the whole of `layer`'s call, are acquired: guess the next
        layer's experts (or take the caller's `hint`: next layer, ids most likely first) and load them, never
        evicting `keys`."""
        nxt = self._next_layer.get(layer)
        if self.guesses is not None:
            likely = self.guesses.predict(nxt, len(keys)) if nxt is not None else []
        elif hint is not None:
            nxt, likely = hint[0], list(hint[1])
        else:
            return
        if not likely or nxt is None:
            return
        with self._cond:
            held = self._cache.holds
            ids = self.guesses.choose(nxt, likely, lambda e: held((nxt, e))) if self.guesses else likely
            if ids:
                self._cache.protect(keys)
                self._submit([(nxt, e) for e in ids])

    def hint(self, layer: int, expert_ids: Sequence[int]) -> None:
        """Load `expert_ids` of `layer` (most likely first), replacing any pending request."""
        with self._cond:
            self._submit([(layer, e) for e in expert_ids])

    def cancel(self) -> None:
        """(`cond` held.) Drop the pending request and its protection; stop the running one after its current
        unit."""
        self._request = None
        self._epoch += 1
        self._cache.end_protection()

    def _submit(self, guess: list[Key]) -> None:
        """(`cond` held.) Protect the guesses already cached; queue the others, replacing any pending request."""
        todo = self._cache.plan_prefetch(guess)
        if self._closed:
            return
        self._epoch += 1
        self._request = (todo, self._epoch) if todo else None
        if todo and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="moeserve-prefetch", daemon=True)
            self._thread.start()
        self._cond.notify_all()

    def wait_idle(self, timeout_s: float = 600.0) -> bool:
        """Block until no request is pending or running (benchmarks, tests). False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._request is None and not self._busy, timeout_s)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._request = None
            self._epoch += 1
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._request is None and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                assert self._request is not None
                keys, epoch = self._request
                self._request = None
                self._busy = True
            try:
                self._load_all(keys, epoch)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _load_all(self, keys: list[Key], epoch: int) -> None:
        for key in keys:
            try:
                if not self._load(key, epoch):
                    return  # no unprotected slot left, or the compute thread moved on
            except Exception as err:  # a wrong or failed prefetch costs nothing: the demand load will retry
                if not self._warned:
                    log.warning("prefetch of expert %d of layer %d failed (%s); demand loads will retry",
                                key[1], key[0], err)
                    self._warned = True

    def _load(self, key: Key, epoch: int) -> bool:
        """Read `key` into a prefetch slot; False when there is none or the request is stale."""
        cache = self._cache
        with self._cond:
            if self._epoch != epoch or self._closed:
                return False
            if cache.holds(key):  # it came in since the request was made
                return True
            slot = cache.take_prefetch_slot(key)
            if slot is None:
                return False
        try:
            nbytes, from_host = self._read(key, slot)
        except Exception:
            with self._cond:
                cache.abandon_read(key, prefetched=True)
                cache.stats.load_errors += 1
                self._cond.notify_all()
            raise
        with self._cond:
            cache.finish_read(key, nbytes, from_host=from_host, prefetched=True)
            self._cond.notify_all()
        return True
