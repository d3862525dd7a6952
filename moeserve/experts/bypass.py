"""The misses of one chunk that admission control refused (expert_admission=policy), and the bypass buffers they are
read into: rows of the store's pool beside its slots, never mapped, each lent once per chunk.

The first `buffers - 1` refused misses of a chunk are read ahead on the I/O threads, each into its own buffer, so
their reads overlap the compute of the experts before them; any later one is read by the compute thread, when its
turn comes, into the last buffer (free again once the caller asks for the run after the one that used it). A
refused miss whose read ahead has landed is lent in one run with the experts beside it (its own buffer), so a bypass
costs the caller no extra call; one read on the compute thread starts a run, never joins one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from moeserve.errors import ExpertLoadError
from moeserve.experts.slot_cache import Key, StoreStats

# fill(key, slot): read `key`'s unit into the pool row `slot` (no lock held); (bytes read, served by the host tier)
Fill = Callable[[Key, int], tuple[int, bool]]
# submit(read, key, buffer): queue it on an I/O thread
Submit = Callable[[Callable[[Key, int], None], Key, int], "Future[None]"]


class BypassReads:
    """One chunk's refused misses: which buffer each is read into and its read in flight."""

    def __init__(self, fill: Fill, cond: threading.Condition, stats: StoreStats, buffers: range,
                 submit: Submit | None) -> None:
        """`buffers`: the pool rows of the bypass buffers; `cond` guards `stats`; `submit` None: no I/O threads."""
        self._fill = fill
        self._cond = cond
        self._stats = stats
        self._buffers = buffers
        self._submit = submit
        self._reads: dict[Key, tuple[int, Future[None] | None]] = {}  # key -> (its buffer, its read ahead or None)

    def __contains__(self, key: object) -> bool:
        return key in self._reads

    def start(self, keys: list[Key]) -> None:
        """The chunk's refused misses, in the order they will be lent: read the first ones ahead."""
        ahead = len(self._buffers) - 1 if self._submit is not None else 0
        for n, key in enumerate(keys):
            if n < ahead:
                assert self._submit is not None
                self._reads[key] = (self._buffers[n], self._submit(self._read, key, self._buffers[n]))
            else:
                self._reads[key] = (self._buffers[-1], None)

    def landed(self, key: Key) -> bool:
        """Whether `key` was read ahead and its read is done, so it may join the run of experts before it."""
        future = self._reads[key][1]
        return future is not None and future.done()

    def take(self, key: Key) -> int:
        """Block until `key`'s unit is in its buffer (reading it here if it was not read ahead); the buffer."""
        buffer, future = self._reads.pop(key)
        if future is None:
            self._read(key, buffer)
        else:
            future.result()
        return buffer

    def settle(self) -> None:
        """Let every read ahead land or fail (the chunk ended early, or a read failed): no buffer is written after
        the chunk."""
        for _, future in self._reads.values():
            if future is not None:
                try:
                    future.result()
                except ExpertLoadError:
                    pass
        self._reads.clear()

    def _read(self, key: Key, buffer: int) -> None:
        """(Any reading thread, no lock held.) `key`'s unit into `buffer`, its bytes counted as a miss's (the miss
        itself was counted by `SlotCache.bypass`); nothing is mapped. A failure raises ExpertLoadError."""
        t0 = time.perf_counter()
        try:
            nbytes, from_host = self._fill(key, buffer)
        except Exception as err:
            with self._cond:
                self._stats.load_errors += 1
            detail = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise ExpertLoadError(f"loading expert {key[1]} of layer {key[0]} failed: {detail}") from err
        with self._cond:
            self._stats.read_seconds += time.perf_counter() - t0
            st = self._stats.layer(key[0])
            if from_host:
                st.bytes_from_host += nbytes
            else:
                st.bytes_from_disk += nbytes
