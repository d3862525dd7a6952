"""Probes of this machine's ceilings: memory read bandwidth and disk read bandwidth (page cache bypassed).

Both are best-of-N: on a shared machine the best run is the one least disturbed, and it is the bandwidth the
hardware can give. Measure them beside every benchmark run, because shared machines drift between runs.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from moeserve.memory.hugepages import huge_page_bytes

DISK_CHUNK_BYTES = 8 * 2**20  # one pread per 8 MiB


def memory_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s: summing a buffer far larger than the caches with all compute threads.

    torch's plain bf16 sum streams at the memory's speed (it accumulates in fp32 internally); asking for an fp32
    result dtype instead converts first and measures the conversion, not the memory. The buffer sits on 2 MiB
    pages where the kernel allows, as the engine's weights do (moeserve.memory.hugepages): the ceiling is what
    the hardware can stream, not what 4 KiB pages let through.
    """
    buf = huge_page_bytes(nbytes // 2 * 2)[0].view(torch.bfloat16).fill_(1)
    buf.sum()  # fault the pages in and warm the kernel
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * buf.element_size() / best


def drop_page_cache(path: Path) -> None:
    """Ask the kernel to forget its cached pages of `path`, so the next read comes from the device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages only: the writer fsyncs its shards
    finally:
        os.close(fd)


def disk_read_bandwidth(paths: Iterable[Path], max_bytes: int = 1024 * 2**20, repeats: int = 2) -> float:
    """Sequential read bandwidth in bytes/s over `paths` (up to max_bytes), page cache dropped before each run."""
    files = [p for p in paths if p.is_file() and p.stat().st_size > 0]
    if not files:
        raise ValueError("disk_read_bandwidth needs at least one non-empty file")
    buf = bytearray(DISK_CHUNK_BYTES)
    view = memoryview(buf)
    best = float("inf")
    total = 0
    for _ in range(repeats):
        for p in files:
            drop_page_cache(p)
        total = 0
        t0 = time.perf_counter()
        for p in files:
            fd = os.open(p, os.O_RDONLY)
            try:
                offset = 0
                while total < max_bytes:
                    n = os.preadv(fd, [view], offset)
                    if n <= 0:
                        break
                    offset += n
                    total += n
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            if total >= max_bytes:
                break
        best = min(best, time.perf_counter() - t0)
    return total / best
