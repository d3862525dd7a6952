"""Resident-set measurements of this process (Linux /proc, with a getrusage fallback elsewhere)."""

from __future__ import annotations

import resource
import sys
from pathlib import Path

_STATUS = Path("/proc/self/status")


def _status_kib(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])  # "VmHWM:   123456 kB"
    except OSError:
        return None
    return None


def current_rss_bytes() -> int:
    """Resident set size now."""
    kib = _status_kib("VmRSS")
    if kib is not None:
        return kib * 1024
    import psutil

    return int(psutil.Process().memory_info().rss)


def peak_rss_bytes() -> int:
    """High-water mark of the resident set since the process started (VmHWM; ru_maxrss elsewhere)."""
    kib = _status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


MMAP_THRESHOLD = 2**20  # allocations at least this large are mmapped, and unmapped (returned) when freed
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)


def fix_mmap_threshold() -> str:
    """Fix glibc's mmap threshold at MMAP_THRESHOLD, once, and say why (the engine logs it at start-up).

    glibc raises its threshold each time a mapped block is freed (up to 32 MiB), after which tensors of 1-32 MiB
    come from the heap and their freed pages mostly stay in the process: measured +50 MiB of RSS in one load of
    two, which a memory_gb promise cannot budget. A fixed threshold turns that off. A threshold the user set in
    MALLOC_MMAP_THRESHOLD_ is kept; elsewhere than glibc nothing is changed."""
    import ctypes
    import os

    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return f"glibc mmap threshold {os.environ['MALLOC_MMAP_THRESHOLD_']} (set by MALLOC_MMAP_THRESHOLD_)"
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 - glibc only
    except (OSError, AttributeError):
        return "the platform's malloc, unchanged (not glibc)"
    if mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1:
        return "glibc's sliding mmap threshold, unchanged (mallopt refused)"
    return (f"glibc mmap threshold fixed at {MMAP_THRESHOLD // 2**20} MiB (auto: freed tensors return to the OS; the "
            "sliding default keeps up to 32 MiB blocks in the heap, RSS memory_gb cannot budget)")
