"""Prefetch: load the experts predicted for the next MoE layer in a background thread, so I/O overlaps compute.

Once a layer's experts are in, the store protects the guesses already cached and submits the others here
(experts/slot_cache.py: `plan_prefetch`). The thread loads them, most likely first, through the store's
`load(key, wanted)`, which puts each into a free slot or the slot of a victim that is neither pinned by the compute
thread, nor being loaded, nor protected (the guessing layer's experts, the guesses: a prefetch never evicts what
it predicted). It stops at the first of: the list is done; `load` found no such slot; the compute thread has moved
on (`cancel`, called when it acquires the next layer: from then on demand loads are the ones that matter). A wrong
guess costs a read and a slot, never correctness: prefetched units are the same bytes a demand miss would read,
and a unit is only visible once fully written.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

log = logging.getLogger("moeserve")

Key = tuple[int, int]  # (layer, expert)
# load(key, wanted): read `key` into a prefetch slot unless `wanted()` (asked under `cond`) is False; False when it
# read nothing and the request should stop (no room, or unwanted). Raises what the read raises.
LoadUnit = Callable[[Key, Callable[[], bool]], bool]


class Prefetcher:
    """One daemon thread per store. Its state is guarded by `cond`, the store's condition variable."""

    def __init__(self, cond: threading.Condition, load: LoadUnit) -> None:
        self._cond = cond
        self._load = load
        self._request: tuple[list[Key], int] | None = None  # (keys, epoch)
        self._epoch = 0  # bumped by cancel(): a running request of an older epoch stops
        self._closed = False
        self._busy = False  # a request is being loaded
        self._warned = False
        self._thread: threading.Thread | None = None

    def submit(self, keys: Sequence[Key]) -> None:
        """(`cond` held.) Replace any pending request with loading `keys`, most likely first."""
        if self._closed:
            return
        self._epoch += 1
        self._request = (list(keys), self._epoch)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="moeserve-prefetch", daemon=True)
            self._thread.start()
        self._cond.notify_all()

    def cancel(self) -> None:
        """(`cond` held.) Drop the pending request and stop the running one after its current unit."""
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
        def wanted() -> bool:  # asked under `cond`, right before a slot is taken
            return self._epoch == epoch and not self._closed

        for key in keys:
            try:
                if not self._load(key, wanted):
                    return  # no unprotected slot left, or the compute thread moved on
            except Exception as err:  # a wrong or failed prefetch costs nothing: the demand load will retry
                if not self._warned:
                    log.warning("prefetch of expert %d of layer %d failed (%s); demand loads will retry",
                                key[1], key[0], err)
                    self._warned = True
