"""Where the host tier's units lie in pinned memory: power-of-two chunks, each holding whole units (pure Python,
no torch: budgets are computed from it before anything is allocated; memory/pinned.py allocates it).

torch's caching host allocator rounds a pinned request up to the next power of two (CachingHostAllocator.h,
`PowerOf2Ceil`): one 90 GiB `pin_memory=True` buffer asks the driver for 128 GiB. Chunks whose sizes ARE powers
of two have nothing to round, and the bytes a budget counts are the chunks' own, slack included
(`ChunkPlan.nbytes`); `capacity_within` gives the most units a budget holds that way.
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 2**20
GiB = 2**30
CHUNK_BYTES = 256 * MiB  # the smallest chunk for the whole-chunk part of a tier (a power of two)
MAX_CHUNK_BYTES = 1 * GiB  # chunks are chosen among powers of two up to this (or one unit, if larger)
# The copier's pinned read buffers (experts/transfer.py): a read into one overlaps the copy out of the other.
STAGING_BUFFERS = 2


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


def staging_pinned_bytes(unit_nbytes: int) -> int:
    """Pinned host RAM the copier's staging buffers take: STAGING_BUFFERS units, each one pinned request that
    torch's allocator rounds up to a power of two."""
    return STAGING_BUFFERS * next_pow2(unit_nbytes)


@dataclass(frozen=True)
class ChunkPlan:
    """How `capacity` units of `unit_nbytes` lie in power-of-two chunks."""

    unit_nbytes: int
    units: tuple[int, ...]  # units in each chunk
    chunk_nbytes: tuple[int, ...]  # bytes of each chunk, each a power of two

    @property
    def capacity(self) -> int:
        return sum(self.units)

    @property
    def nbytes(self) -> int:
        """What the chunks take, slack included: the figure a budget must count."""
        return sum(self.chunk_nbytes)

    @property
    def slack_bytes(self) -> int:
        return self.nbytes - self.capacity * self.unit_nbytes

    def describe(self) -> str:
        if not self.units:
            return "no chunks"
        sizes = sorted(set(self.chunk_nbytes), reverse=True)
        counts = ", ".join(f"{self.chunk_nbytes.count(n)} x {fmt_bytes(n)}" for n in sizes)
        return f"{len(self.units)} chunks ({counts}; {fmt_bytes(self.slack_bytes)} slack)"


def fmt_bytes(n: float) -> str:
    """'1.25 GiB', or '12.3 MiB' below 1 GiB."""
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / MiB:.1f} MiB"


def chunk_size(unit_nbytes: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """The full-chunk size for units of `unit_nbytes`: among the powers of two from max(chunk_bytes, one unit) to
    max(MAX_CHUNK_BYTES, one unit), the one wasting the smallest share on slack (the smaller on a tie)."""
    low = next_pow2(max(chunk_bytes, unit_nbytes))
    high = max(MAX_CHUNK_BYTES, low)
    best, best_waste = low, 1.0
    size = low
    while size <= high:
        waste = (size % unit_nbytes) / size
        if waste < best_waste - 1e-12:
            best, best_waste = size, waste
        size *= 2
    return best


def plan_chunks(capacity: int, unit_nbytes: int, chunk_bytes: int = CHUNK_BYTES) -> ChunkPlan:
    """Full chunks of `chunk_size`, then power-of-two chunks for the units left over: one when it wastes at most an
    eighth, else the largest one they fill and again for the rest (10 units of 60 MiB: 512 + 128 MiB, not 1 GiB:
    seen on an H200)."""
    if unit_nbytes <= 0 or capacity <= 0:
        return ChunkPlan(max(unit_nbytes, 0), (), ())
    size = chunk_size(unit_nbytes, chunk_bytes)
    per = size // unit_nbytes
    full, rest = divmod(capacity, per)
    units, sizes = [per] * full, [size] * full
    while rest:  # the units left over: one chunk when its slack is small, else the largest chunk they fill
        need = rest * unit_nbytes
        take, nbytes = rest, next_pow2(need)
        below = nbytes // 2
        if nbytes - need > need // 8 and below >= unit_nbytes:
            take, nbytes = min(rest, below // unit_nbytes), below
        units.append(take)
        sizes.append(nbytes)
        rest -= take
    return ChunkPlan(unit_nbytes, tuple(units), tuple(sizes))


def capacity_within(budget_bytes: int, unit_nbytes: int, max_units: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """The most units (<= max_units) whose chunks, slack included, fit in `budget_bytes`."""
    lo, hi = 0, max(0, max_units)  # plan_chunks(c).nbytes grows with c: the largest fitting c by bisection
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if plan_chunks(mid, unit_nbytes, chunk_bytes).nbytes <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo
