"""Quick probes of this machine's bandwidths, behind the speed ceilings of `moeserve plan` and `moeserve bench`.

Memory, two probes that measure different things, so each caller keeps the figure its ceilings were set against:

- `memory_bandwidth` (bench): READ bandwidth, summing a buffer far larger than the caches with all compute
  threads, on 2 MiB pages where the kernel allows (as the engine's weights are); best of N, in bytes/s. Decode
  reads its weights, so this is the ceiling a benchmark run is set against.
- `ram_copy_bandwidth` (plan): COPY bandwidth, best of 3 torch copies of a buffer, reported as bytes copied per
  second. A copy reads and writes each byte, so at the same moment it gives a lower figure than the read probe
  (docs/benchmarks.md). `moeserve plan` takes it as the fast tier's speed on CPU.

Disk, one cold-read loop (`cold_read_bandwidth`: the ranges' page cache dropped through memory/pagecache.py,
then sequential 8 MiB preads) behind two callers:

- `disk_read_bandwidth` (bench): whole files (the benchmark's shards), best of 2 runs, in bytes/s;
- `tensor_read_bandwidth` (plan): a checkpoint's own expert tensors, once, as a `Bandwidth` whose note says when
  the page cache could not be dropped (the figure may then be the cache's, not the device's).

Host -> device: `host_to_device_bandwidth`, pinned copies where pinning works, pageable blocking ones where it
does not (as the engine would then copy), through `DeviceOps` (memory/device.py).

Best-of-N, where N > 1: on a shared machine the best run is the one least disturbed, and it is the bandwidth the
hardware can give. The bench measures beside every run, because shared machines drift between runs.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from moeserve.checkpoint.safetensors_file import TensorRef
from moeserve.memory.device import DeviceOps, host_buffer
from moeserve.memory.hugepages import huge_page_bytes
from moeserve.memory.pagecache import drop_file

MiB = 2**20
DISK_CHUNK_BYTES = 8 * MiB  # one pread per 8 MiB

FileRange = tuple[Path, int, int]  # (file, first byte, bytes)


@dataclass(frozen=True)
class Bandwidth:
    bytes_per_s: float
    nbytes: int  # what the probe moved
    note: str = ""

    @property
    def gb_per_s(self) -> float:
        return self.bytes_per_s / 1e9


def memory_bandwidth(nbytes: int = 512 * MiB, repeats: int = 5) -> float:
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


def cold_read_bandwidth(ranges: Sequence[FileRange], max_bytes: int, repeats: int = 1) -> Bandwidth:
    """Best of `repeats` sequential reads of `ranges` (in order, up to `max_bytes`), each after dropping the
    ranges' page cache; the note says when it could not be dropped (the figure may then be optimistic)."""
    buf = memoryview(bytearray(DISK_CHUNK_BYTES))
    best, total, dropped = float("inf"), 0, True
    for _ in range(repeats):
        dropped = _drop(ranges) and dropped
        t0 = time.perf_counter()
        total = _read(ranges, max_bytes, buf)
        best = min(best, time.perf_counter() - t0)
    note = "" if dropped else "page cache could not be dropped: may be optimistic"
    return Bandwidth(total / max(best, 1e-9), total, note)


def _drop(ranges: Sequence[FileRange]) -> bool:
    try:
        for path, offset, nbytes in ranges:
            drop_file(path, offset, nbytes)
    except OSError:
        return False
    return True


def _read(ranges: Sequence[FileRange], max_bytes: int, buf: memoryview) -> int:
    """Bytes read from `ranges`, in order, stopping at the first chunk that reaches `max_bytes`."""
    total = 0
    for path, offset, nbytes in ranges:
        fd = os.open(path, os.O_RDONLY)
        try:
            pos, end = offset, offset + nbytes
            while pos < end and total < max_bytes:
                n = os.preadv(fd, [buf[: min(len(buf), end - pos)]], pos)
                if n <= 0:
                    break
                pos += n
                total += n
            if hasattr(os, "posix_fadvise"):  # leave the page cache as the probe found it
                os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        if total >= max_bytes:
            break
    return total


def disk_read_bandwidth(paths: Iterable[Path], max_bytes: int = 1024 * MiB, repeats: int = 2) -> float:
    """Sequential read bandwidth in bytes/s over the files `paths` (up to max_bytes), page cache dropped before
    each run (ValueError when none of them is a non-empty file)."""
    files = [(p, 0, p.stat().st_size) for p in paths if p.is_file() and p.stat().st_size > 0]
    if not files:
        raise ValueError("disk_read_bandwidth needs at least one non-empty file")
    return cold_read_bandwidth(files, max_bytes, repeats).bytes_per_s


def tensor_read_bandwidth(refs: Sequence[TensorRef], max_bytes: int = 256 * MiB) -> Bandwidth | None:
    """Cold read bandwidth over the tensors `refs` (whole tensors, from the first, until `max_bytes` is reached),
    or None when there is nothing to read."""
    chosen: list[FileRange] = []
    total = 0
    for ref in refs:
        if total >= max_bytes:
            break
        chosen.append((ref.path, ref.offset, ref.nbytes))
        total += ref.nbytes
    return cold_read_bandwidth(chosen, total) if chosen else None


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_read_bandwidth(device: torch.device, nbytes: int = 256 * MiB, repeats: int = 3) -> float:
    """Memory bandwidth of `device` in bytes/s: best of `repeats` copies of an `nbytes` buffer within it, counting
    the bytes read and written (what a kernel streaming its weights once can hope for, read and write alike)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def matmul_flops(device: torch.device, rows: int = 256, k: int = 2048, repeats: int = 3) -> float:
    """bf16 GEMM rate of `device` in flop/s: best of `repeats` [rows, k] x [k, k] products (a proxy for the expert
    kernels' compute rate at prefill; decode is bound by bandwidth, measured apart)."""
    a = torch.ones(rows, k, dtype=torch.bfloat16, device=device)
    b = torch.ones(k, k, dtype=torch.bfloat16, device=device)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * rows * k * k / best
