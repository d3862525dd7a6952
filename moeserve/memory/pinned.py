"""Host memory for the host tier, pinned in fixed power-of-two chunks, so that pinning cannot blow up.

torch's caching host allocator rounds a pinned request up to the next power of two (CachingHostAllocator.h,
`PowerOf2Ceil`): one 90 GiB `pin_memory=True` buffer asks the driver for 128 GiB, and either fails or locks
nearly all RAM. So the host tier is allocated in chunks whose sizes ARE powers of two (nothing to round), each
holding whole expert units (a unit never straddles two chunks), and the bytes counted against the budget are the
chunks' own, slack included (`ChunkPlan.nbytes`; `capacity_within` gives the most units a budget holds).

Where pinning a chunk fails (WSL, a locked-memory limit, a container), that chunk and the rest are pageable and
the fallback is logged with the driver's reason (their copies are then synchronous: experts/transfer.py). On
`close()` the chunks are dropped and torch's cache of freed pinned blocks is emptied (torch keeps them for reuse
otherwise, and the RAM stays locked until the process exits).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from moeserve.memory.chunks import ChunkPlan, fmt_bytes

log = logging.getLogger("moeserve")


def _host_cache_release() -> Callable[[], None] | None:
    """torch's call that frees its cached pinned blocks: `torch.accelerator.empty_host_cache` (2.13), the private
    `torch._C._host_emptyCache` of some earlier builds, or None (torch 2.11 has neither: found on a GPU run)."""
    found = getattr(torch.accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
    return found if callable(found) else None


def empty_host_cache() -> None:
    """Give torch's cached free pinned blocks back to the OS (a no-op where no accelerator was initialised, and
    where this torch build has no call for it: then they go back at exit, said once in the log)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return
    release = _host_cache_release()
    if release is None:
        if not getattr(empty_host_cache, "warned", False):
            log.warning("torch %s cannot return cached pinned memory before exit (no empty_host_cache): "
                        "a closed host tier's pinned bytes stay reserved by this process", torch.__version__)
            empty_host_cache.warned = True  # type: ignore[attr-defined]
        return
    release()


class ChunkedHostPool:
    """The host tier's bytes: `plan`'s chunks, pinned by `pin(nbytes)` while it works (pageable after the first
    failure, logged), and one uint8 view per unit slot. `pin=None`: pageable (a CPU fast tier needs no pinning)."""

    def __init__(self, plan: ChunkPlan, pin: Callable[[int], torch.Tensor] | None,
                 release: Callable[[], None] = empty_host_cache) -> None:
        self.plan = plan
        self._release = release
        self.why_pageable: str | None = None if pin is not None else "no device to copy to"
        self.chunks: list[torch.Tensor] = []
        self.chunk_pinned: list[bool] = []
        for i, nbytes in enumerate(plan.chunk_nbytes):
            chunk = None
            if pin is not None and self.why_pageable is None:
                try:
                    chunk = pin(nbytes)
                except RuntimeError as err:  # torch raises RuntimeError for every pinning failure
                    self.why_pageable = str(err).splitlines()[0] if str(err) else type(err).__name__
                    log.warning("host tier: pinning chunk %d of %d (%s) failed (%s): it and the %d after it are "
                                "pageable, and their copies to the GPU synchronous", i + 1, len(plan.units),
                                fmt_bytes(nbytes), self.why_pageable, len(plan.units) - i - 1)
            self.chunk_pinned.append(chunk is not None)
            self.chunks.append(chunk if chunk is not None else torch.empty(nbytes, dtype=torch.uint8))
        # slot s -> a [unit_nbytes] view inside one chunk
        self.slots: list[torch.Tensor] = [chunk[j * plan.unit_nbytes:(j + 1) * plan.unit_nbytes]
                                          for chunk, n in zip(self.chunks, plan.units, strict=True) for j in range(n)]

    @property
    def capacity(self) -> int:
        return self.plan.capacity

    @property
    def nbytes(self) -> int:
        """The chunks' bytes, as allocated (the figures stay after `close`)."""
        return self.plan.nbytes

    @property
    def pinned_bytes(self) -> int:
        return sum(n for n, p in zip(self.plan.chunk_nbytes, self.chunk_pinned, strict=True) if p)

    @property
    def all_pinned(self) -> bool:
        return bool(self.chunk_pinned) and all(self.chunk_pinned)

    def is_pinned(self, t: torch.Tensor) -> bool | None:
        """Whether `t` lies in a pinned chunk (None: not in this pool)."""
        ptr = t.data_ptr()
        for chunk, pinned in zip(self.chunks, self.chunk_pinned, strict=True):
            start = chunk.data_ptr()
            if start <= ptr < start + chunk.numel():
                return pinned
        return None

    def describe(self) -> str:
        """'3.00 GiB pinned in 12 chunks (...)', or the pinned / pageable split and why."""
        where = f"in {self.plan.describe()}"
        if self.all_pinned:
            return f"{fmt_bytes(self.nbytes)} pinned {where}"
        if self.pinned_bytes == 0:
            return f"{fmt_bytes(self.nbytes)} pageable {where} ({self.why_pageable})"
        return (f"{fmt_bytes(self.pinned_bytes)} pinned + {fmt_bytes(self.nbytes - self.pinned_bytes)} pageable {where} "
                f"(pinning failed: {self.why_pageable})")

    def close(self) -> None:
        """Drop the chunks (every slot view with them) and empty torch's pinned cache so the RAM is unlocked."""
        if not self.chunks:
            return
        self.slots.clear()
        self.chunks.clear()
        if self.pinned_bytes:
            self._release()
