"""The misses of one chunk that admission control refused (expert_admission=policy), and the bypass buffers they are
read into: rows of the store's pool beside its slots, never mapped, each lent once per chunk.

The first `buffers - 1` refused misses of a chunk are read ahead on the I/O threads, each into its own buffer, so
their reads overlap the compute of the experts before them; any later one is read by the compute thread, when its
turn comes, into the last buffer (free again once the caller asks for the run after the one that used it).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

from moeserve.errors import ExpertLoadError
from moeserve.experts.slot_cache import Key

# read(key, buffer): fill the pool row `buffer` with `key`'s unit and count its bytes; raises ExpertLoadError
ReadInto = Callable[[Key, int], None]
# submit(read, key, buffer): queue it on an I/O thread (None: no I/O threads)
Submit = Callable[[ReadInto, Key, int], Future[None]]


class BypassReads:
    """One chunk's refused misses: which buffer each is read into and its read in flight."""

    def __init__(self, read: ReadInto, first_buffer: int, buffers: int, submit: Submit | None) -> None:
        self._read = read
        self._first = first_buffer
        self._buffers = buffers
        self._submit = submit
        self._reads: dict[Key, tuple[int, Future[None] | None]] = {}  # key -> (its buffer, its read ahead or None)

    def __contains__(self, key: object) -> bool:
        return key in self._reads

    def start(self, keys: list[Key]) -> None:
        """The chunk's refused misses, in the order they will be lent: read the first ones ahead."""
        ahead = self._buffers - 1 if self._submit is not None else 0
        last = self._first + self._buffers - 1
        for n, key in enumerate(keys):
            if n < ahead:
                assert self._submit is not None
                self._reads[key] = (self._first + n, self._submit(self._read, key, self._first + n))
            else:
                self._reads[key] = (last, None)

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
