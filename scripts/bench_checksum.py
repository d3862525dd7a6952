"""What verifying a miss costs: the unit checksum against the read of the unit itself.

    .venv/bin/python scripts/bench_checksum.py [--unit-mb 9.4] [--units 48]

Writes a file of `units` random units (default: one Qwen3-30B-A3B bf16 expert, 9.4 MB, each), then reads them back
one by one with the engine's FileReader (O_DIRECT where the file system allows, else through the page cache with
the pages dropped after: the uncached read a miss pays) and checksums each with the checksum the engine uses
(experts/verify.py). Prints both speeds and the checksum's time as a fraction of the read's, alternating rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moeserve import kernels  # noqa: E402
from moeserve.checkpoint.safetensors_file import FileReader  # noqa: E402
from moeserve.experts.verify import _zlib_crc32, choose_checksum  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--unit-mb", type=float, default=9.4)
    ap.add_argument("--units", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(f"kernels: {kernels.load().reason}")
    checksum = choose_checksum()
    nbytes = int(args.unit_mb * 1e6) // 4096 * 4096
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/var/tmp")) as tmp:
        path = Path(tmp) / "units.bin"
        with open(path, "wb") as f:
            for i in range(args.units):
                f.write(bytes(torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                                            generator=torch.Generator().manual_seed(i)).numpy()))
            f.flush()
            os.fsync(f.fileno())
        reader = FileReader(drop_page_cache=True)
        unit = torch.empty(nbytes, dtype=torch.uint8)
        reads, hashes = [], []
        for _ in range(args.rounds):
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
            for i in range(args.units):
                t0 = time.perf_counter()
                reader.read_run(path, i * nbytes, [unit], f"unit {i}")
                t1 = time.perf_counter()
                checksum.fn(unit)
                t2 = time.perf_counter()
                reads.append(t1 - t0)
                hashes.append(t2 - t1)
        reader.close()
    r, h = statistics.median(reads), statistics.median(hashes)
    print(f"checksum {checksum.name}: {nbytes / h / 1e9:.1f} GB/s ({h * 1e3:.2f} ms per {nbytes / 1e6:.1f} MB unit)")
    print(f"uncached read: {nbytes / r / 1e9:.2f} GB/s ({r * 1e3:.2f} ms per unit)")
    print(f"checksum / read per miss: {h / r:.3f} (medians of {len(reads)} misses)")
    fallback = statistics.median(_timed(_zlib_crc32, unit) for _ in range(5))
    print(f"fallback without the C++ kernels ({_zlib_crc32.__name__}): {nbytes / fallback / 1e9:.1f} GB/s, "
          f"{fallback / r:.3f} of the read")


def _timed(fn: Callable[[torch.Tensor], int], unit: torch.Tensor) -> float:
    t0 = time.perf_counter()
    fn(unit)
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
