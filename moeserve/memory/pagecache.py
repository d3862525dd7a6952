"""Drop files (or byte ranges of them) from the page cache, and measure how much of a file is there.

The one place the package asks the kernel to forget a file's cached pages (fsync, so no dirty page is left to
stay, then POSIX_FADV_DONTNEED). Two users:

- the bandwidth probes (memory/probes.py) drop what they are about to read, so the figure is the device's and
  not the page cache's;
- the benchmark (bench/runner.py, bench/gguf_export.py) drops the files it wrote or reads as inputs. A file
  written by the bench process (the GGUF export: 7.7 GB for the large shape; the synthetic checkpoint) stays in
  the page cache, charged to the bench's own cgroup. A peer started next in a memory cgroup of its own then maps
  those pages without being charged for them: under `--memory-limit-gb 4`, llama.cpp ran with 7.4 GiB resident
  and 0.18 GiB charged, not limited at all. Dropping them first makes every engine read its weights into its own
  cgroup.

Readers that drop what they have just read as part of their I/O path (checkpoint/safetensors_file.py,
experts/spill.py) call posix_fadvise themselves on the descriptor they already hold.

`resident_bytes` asks the kernel (mincore(2) on a read-only mapping) how much of a file is in the page cache.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("moeserve")


@dataclass
class DropReport:
    """What `drop` did: files dropped, their bytes resident before and after (None: mincore unavailable), and one
    line per file that could not be dropped."""

    files: int = 0
    resident_before: int | None = 0
    resident_after: int | None = 0
    problems: list[str] = field(default_factory=list)

    def describe(self) -> str:
        sizes = ("" if self.resident_before is None or self.resident_after is None else
                 f": {self.resident_before / 2**20:.0f} MiB in the page cache before, "
                 f"{self.resident_after / 2**20:.0f} MiB after")
        failed = f"; {len(self.problems)} failed: {self.problems[0]}" if self.problems else ""
        return f"page cache: dropped {self.files} file(s){sizes}{failed}"


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name, use_errno=True)
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mmap.restype = ctypes.c_void_p
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    return libc


def resident_bytes(path: str | Path) -> int | None:
    """Bytes of `path` in the page cache now (whole pages), or None where mincore(2) is not available. Maps the
    file read-only without touching it (mapping reads nothing), asks mincore, unmaps."""
    libc = _libc()
    size = os.path.getsize(path)
    if libc is None or size == 0:
        return None if libc is None else 0
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(address, size, vec) != 0:
                return None
            return sum(b & 1 for b in vec) * mmap.PAGESIZE
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)


def drop_file(path: str | Path, offset: int = 0, nbytes: int = 0) -> None:
    """fsync `path`, then tell the kernel its cached pages of `nbytes` bytes from `offset` (0: to the end of the
    file) are not needed (POSIX_FADV_DONTNEED). OSError on failure, also where the platform has no
    posix_fadvise. Pages mapped by a process stay whatever is asked."""
    fadvise = getattr(os, "posix_fadvise", None)
    if fadvise is None:
        raise OSError("posix_fadvise is not available on this platform")
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # written pages must be clean to be dropped
        fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def drop(paths: Iterable[str | Path]) -> DropReport:
    """Drop every file of `paths` (folders: the files in them, recursively) from the page cache; never raises:
    what failed is in the report, one line per file, and logged."""
    files = [f for p in map(Path, paths) for f in (sorted(x for x in p.rglob("*") if x.is_file()) if p.is_dir()
                                                    else [p])]
    report = DropReport()
    for f in files:
        before = _resident_or_none(f)
        try:
            drop_file(f)
        except OSError as err:
            report.problems.append(f"{f}: {err.strerror or err}")
            log.warning("could not drop %s from the page cache: %s", f, err.strerror or err)
            continue
        report.files += 1
        after = _resident_or_none(f)
        report.resident_before = None if before is None or report.resident_before is None else \
            report.resident_before + before
        report.resident_after = None if after is None or report.resident_after is None else \
            report.resident_after + after
    return report


def _resident_or_none(path: Path) -> int | None:
    try:
        return resident_bytes(path)
    except (OSError, ValueError):
        return None
