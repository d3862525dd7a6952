"""Quick bandwidth probes (a fraction of a second each) behind the speed ceilings `moeserve plan` prints.

- RAM: copy of a buffer with torch (read + write of `nbytes`; reported as bytes copied per second).
- Disk: cold reads of a checkpoint's own expert tensors with pread, after dropping their page cache with
  posix_fadvise(DONTNEED), so the figure is the device's and not the kernel cache's (dirty or mapped pages cannot
  be dropped: a checkpoint written seconds ago may still read at page-cache speed, and the probe says so).
- Host -> GPU: pinned copies on CUDA machines, pageable ones where pinning is unavailable (said in the note).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moeserve.checkpoint.safetensors_file import FileReader, TensorRef
from moeserve.experts.transfer import DeviceOps, host_buffer

MiB = 2**20


@dataclass(frozen=True)
class Bandwidth:
    bytes_per_s: float
    nbytes: int  # what the probe moved
    note: str = ""

    @property
    def gb_per_s(self) -> float:
        return self.bytes_per_s / 1e9


def ram_copy_bandwidth(nbytes: int = 128 * MiB, repeats: int = 3) -> Bandwidth:
    """Best of `repeats` copies of an `nbytes` buffer (bytes copied per second)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return Bandwidth(nbytes / best, nbytes)


def disk_read_bandwidth(refs: Sequence[TensorRef], max_bytes: int = 256 * MiB) -> Bandwidth | None:
    """Cold pread bandwidth over `refs` (up to `max_bytes`), or None when there is nothing to read."""
    chosen, total = [], 0
    for ref in refs:
        if total >= max_bytes:
            break
        chosen.append(ref)
        total += ref.nbytes
    if not chosen:
        return None
    dropped = _drop_page_cache(chosen)
    reader = FileReader(drop_page_cache=True)
    buf = torch.empty(max(r.nbytes for r in chosen), dtype=torch.uint8)
    try:
        t0 = time.perf_counter()
        for ref in chosen:
            reader.read_into(ref, buf[: ref.nbytes])
        seconds = time.perf_counter() - t0
    finally:
        reader.close()
    note = "" if dropped else "page cache could not be dropped: may be optimistic"
    return Bandwidth(total / max(seconds, 1e-9), total, note)


def _drop_page_cache(refs: Sequence[TensorRef]) -> bool:
    if not hasattr(os, "posix_fadvise"):
        return False
    for ref in refs:
        fd = os.open(ref.path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, ref.offset, ref.nbytes, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def host_to_device_bandwidth(ops: DeviceOps, device: torch.device, nbytes: int = 64 * MiB) -> Bandwidth:
    """Host -> device copy bandwidth through `ops` (CudaOps on a GPU; tests pass a fake): from pinned memory, or,
    where pinning is unavailable (WSL, a locked-memory limit), from pageable memory with blocking copies, as the
    engine would then copy, and the note says so."""
    src, why_not = host_buffer(ops, nbytes)
    pinned = why_not is None
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    ops.synchronize(ops.copy(dst, src, non_blocking=pinned))  # warm-up
    t0 = time.perf_counter()
    ops.synchronize(ops.copy(dst, src, non_blocking=pinned))
    seconds = time.perf_counter() - t0
    note = "" if pinned else f"pinned memory unavailable ({why_not}): pageable, blocking copies"
    return Bandwidth(nbytes / max(seconds, 1e-9), nbytes, note)
