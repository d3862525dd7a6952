"""What verifying a miss costs: the unit checksum against the read of the unit itself.

Writes a file of --units random units (default: one Qwen3-30B-A3B bf16 expert, 9.4 MB, each), then reads them back
one by one with the engine's FileReader (O_DIRECT where the file system allows, else through the page cache with
the pages dropped after: the uncached read a miss pays) and checksums each with the checksum the engine uses
(experts/verify.py). Prints both speeds and the checksum's time as a fraction of the read's, alternating rounds.

    moeserve bench checksum --unit-mb 9.4 --units 48
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moeserve.bench.variants import add_parser, add_repeats_flag, require_positive


def register(sub: argparse._SubParsersAction) -> None:
    p = add_parser(sub, "checksum", __doc__)
    p.add_argument("--unit-mb", type=float, default=9.4, help="bytes of one unit, in MB (default 9.4)")
    p.add_argument("--units", type=int, default=48, help="units in the file (default 48)")
    add_repeats_flag(p, 3)
    p.add_argument("--dir", type=Path, default=None,
                   help="where the file is written (default $TMPDIR or /var/tmp: a disk, not a tmpfs)")
    p.set_defaults(func=run)


def _write_units(path: Path, units: int, nbytes: int) -> None:
    import torch

    with open(path, "wb") as f:
        for i in range(units):
            f.write(bytes(torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                                        generator=torch.Generator().manual_seed(i)).numpy()))
        f.flush()
        os.fsync(f.fileno())


def _read_and_hash(path: Path, units: int, nbytes: int, repeats: int, checksum: Callable[[Any], int]
                   ) -> tuple[list[float], list[float], Any]:
    """Seconds of each uncached unit read and of its checksum, over `repeats` passes; and the last unit read."""
    import torch

    from moeserve.checkpoint.safetensors_file import FileReader

    reader = FileReader(drop_page_cache=True)
    unit = torch.empty(nbytes, dtype=torch.uint8)
    reads, hashes = [], []
    for _ in range(repeats):
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        for i in range(units):
            t0 = time.perf_counter()
            reader.read_run(path, i * nbytes, [unit], f"unit {i}")
            t1 = time.perf_counter()
            checksum(unit)
            reads.append(t1 - t0)
            hashes.append(time.perf_counter() - t1)
    reader.close()
    return reads, hashes, unit


def _timed(fn: Callable[[Any], int], unit: Any) -> float:
    t0 = time.perf_counter()
    fn(unit)
    return time.perf_counter() - t0


def run(args: argparse.Namespace) -> int:
    from moeserve import kernels
    from moeserve.experts.verify import _zlib_crc32, choose_checksum

    require_positive(unit_mb=args.unit_mb, units=args.units, repeats=args.repeats)
    print(f"kernels: {kernels.load().reason}")
    checksum = choose_checksum()
    nbytes = max(4096, int(args.unit_mb * 1e6) // 4096 * 4096)  # whole 4 KiB pages: O_DIRECT reads them
    with tempfile.TemporaryDirectory(dir=args.dir or os.environ.get("TMPDIR", "/var/tmp")) as tmp:
        path = Path(tmp) / "units.bin"
        _write_units(path, args.units, nbytes)
        reads, hashes, unit = _read_and_hash(path, args.units, nbytes, args.repeats, checksum.fn)
    r, h = statistics.median(reads), statistics.median(hashes)
    print(f"checksum {checksum.name}: {nbytes / h / 1e9:.1f} GB/s ({h * 1e3:.2f} ms per {nbytes / 1e6:.1f} MB unit)")
    print(f"uncached read: {nbytes / r / 1e9:.2f} GB/s ({r * 1e3:.2f} ms per unit)")
    print(f"checksum / read per miss: {h / r:.3f} (medians of {len(reads)} misses)")
    fallback = statistics.median(_timed(_zlib_crc32, unit) for _ in range(5))
    print(f"fallback without the C++ kernels ({_zlib_crc32.__name__}): {nbytes / fallback / 1e9:.1f} GB/s, "
          f"{fallback / r:.3f} of the read")
    return 0
