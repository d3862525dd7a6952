"""Prefetch: load the experts predicted for the next MoE layer in a background thread, so I/O overlaps compute.

The MoE block of layer L predicts layer L+1's experts (L+1's router applied to L's hidden states) and hands them
to the store with its `experts(...)` call; once L's own experts are in, the store submits them here. The thread
loads them, most likely first, into free slots or the slots of unpinned victims, and stops at the first of:
the list is done; no slot is left that is neither pinned by the compute thread, nor one of the guessing layer's
experts, nor prefetched by this request;
the compute thread has moved on (`cancel`, called when it acquires the next layer: from then on demand loads are
the ones that matter). A wrong guess costs a read and a slot, never correctness: prefetched units are the same
bytes a demand miss would read, and a unit is only visible once fully written.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moeserve.experts.store import ExpertStore

log = logging.getLogger("moeserve")


class Prefetcher:
    """One daemon thread per store. All state is guarded by the store's condition variable."""

    def __init__(self, store: ExpertStore) -> None:
        self.store = store
        self._cond = store._cond
        self._request: tuple[int, list[int], frozenset[tuple[int, int]]] | None = None
        self._epoch = 0  # bumped by cancel(): a running request of an older epoch stops
        self._closed = False
        self._busy = False  # a request is being loaded
        self._warned = False
        self._thread: threading.Thread | None = None

    def submit(self, layer: int, expert_ids: Sequence[int], protect: Collection[tuple[int, int]] = ()) -> None:
        """Replace any pending request with loading `expert_ids` of `layer` (most likely first), never evicting
        `protect` (the experts of the layer that made the guess, as the cache simulator models it)."""
        with self._cond:
            if self._closed:
                return
            self._request = (layer, list(expert_ids), frozenset(protect))
            self._epoch += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="moeserve-prefetch", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def cancel(self) -> None:
        """(Store lock held.) Drop the pending request and stop the running one after its current unit."""
        self._request = None
        self._epoch += 1

    def wait_idle(self, timeout_s: float = 10.0) -> bool:
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
                (layer, expert_ids, protect), epoch = self._request, self._epoch
                self._request = None
                self._busy = True
            try:
                self._load_all(layer, expert_ids, protect, epoch)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _load_all(self, layer: int, expert_ids: list[int], protect: frozenset[tuple[int, int]], epoch: int) -> None:
        store = self.store
        mine = set(protect)  # the guessing layer's experts and the units this request brought in: never victims

        def wanted() -> bool:  # checked under the store lock, right before a slot is taken
            return self._epoch == epoch and not self._closed

        for expert in expert_ids:
            key = (layer, expert)
            with self._cond:
                if not wanted():
                    return
                if key in store._slot_of or key in store._loading:
                    continue
            try:
                if not store._load(key, prefetched=True, protect=mine, wanted=wanted):
                    return  # no unprotected slot left, or the compute thread moved on
            except Exception as err:  # a wrong or failed prefetch costs nothing: the demand load will retry
                if not self._warned:
                    log.warning("prefetch of expert %d of layer %d failed (%s); demand loads will retry",
                                expert, layer, err)
                    self._warned = True
                continue
            mine.add(key)
