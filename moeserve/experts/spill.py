"""A spill file: expert units computed once from the checkpoint (e.g. quantized on load) kept on a local disk, so
an offloaded miss reads the finished unit instead of recomputing it from the larger checkpoint tensors.

    <dir>/<fingerprint>/units.bin    header (magic, JSON, CRC-32 of the JSON), then unit i at data_offset + i*stride

The JSON holds the fingerprint (checkpoint files, config, unit layout, what made the units), the unit size, the
stride, the number of units, the checksum used (experts/verify.py) and one checksum per unit. A file is used only
when its header parses, its CRC matches, every field equals what this engine expects and the file size is exactly
right; otherwise it is rebuilt (one log line says why). Every unit is then checked against its checksum each time a
miss reads it (the store's UnitVerifier, seeded from this header): a unit corrupted on disk fails the request that
needs it with an error naming this file, never a wrong answer. Builds write to a temporary file that is renamed
into place when complete, under an exclusive lock, so two engines starting together build it once and a killed
build never leaves a file that passes. The user's model folder is never written to.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import struct
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from moeserve.checkpoint.safetensors_file import FileReader
from moeserve.experts.verify import Checksum, checksum_named, choose_checksum

log = logging.getLogger("moeserve")

MAGIC = b"MOESERVE-UNITS1\n"
ALIGN = 4096  # data offset and stride: page-aligned units
_SYNC_EVERY_BYTES = 256 * 2**20  # flush and drop written pages this often: the page cache stays small

Key = tuple[int, int]


def default_spill_root() -> Path:
    return Path.home() / ".cache" / "moeserve" / "units"


def fingerprint(files: Sequence[Path], extra: str) -> str:
    """A digest of the checkpoint files the units come from (name, size, modification time) and `extra` (the
    config, the unit layout, how units are made). Any change gives another fingerprint, so a stale file is
    never used."""
    h = hashlib.sha256()
    for path in sorted(set(files)):
        st = path.stat()
        h.update(f"{path.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    h.update(extra.encode())
    return h.hexdigest()[:32]


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class UnitSpill:
    """Read access to a complete, validated spill file. Build or open one with `open_or_build`."""

    def __init__(self, path: Path, keys: Sequence[Key], unit_nbytes: int, stride: int, data_offset: int,
                 checksum_name: str, crcs: Sequence[int]) -> None:
        self.path = path
        self.keys = list(keys)
        self.index = {k: i for i, k in enumerate(keys)}
        self.checksum_name, self._crcs = checksum_name, list(crcs)
        self.unit_nbytes, self.stride, self.data_offset = unit_nbytes, stride, data_offset  # public: tests, tools
        self.reader = FileReader(drop_page_cache=True)

    def read_unit(self, key: Key, unit_bytes: torch.Tensor) -> None:
        """Fill `unit_bytes` (contiguous CPU uint8 of unit_nbytes) with unit `key`: one read."""
        offset = self.data_offset + self.index[key] * self.stride
        self.reader.read_run(self.path, offset, [unit_bytes], f"unit {key} of {self.path.name}")

    def checksums(self) -> dict[Key, int]:
        """Each unit's checksum as written (with `checksum_name`) when the unit was made."""
        return dict(zip(self.keys, self._crcs))

    def close(self) -> None:
        self.reader.close()


def open_or_build(
    root: Path,
    fp: str,
    keys: Sequence[Key],
    unit_nbytes: int,
    make_unit: Callable[[Key, torch.Tensor], None],
    what: str,
    checksum: Checksum | None = None,
) -> UnitSpill | None:
    """The spill file of fingerprint `fp` under `root`, built first if missing or invalid (`make_unit(key, out)`
    fills one unit). None when it cannot be built here (no space, read-only disk): the caller keeps making
    units on each miss, and the reason is logged."""
    folder = root / fp
    path = folder / "units.bin"
    stride = _round_up(unit_nbytes, ALIGN)
    checksum = checksum or choose_checksum()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another engine building the same file: wait for it
            problem = _check(path, fp, keys, unit_nbytes, stride)
            if problem is None:
                log.info("%s: using %s", what, path)
            else:
                if problem != "missing":
                    log.warning("%s: %s is unusable (%s): rebuilding it", what, path, problem)
                need = len(keys) * stride + ALIGN
                free = shutil.disk_usage(folder).free
                if free < need + 2**30:
                    log.warning("%s: not written (%.1f GiB needed, %.1f GiB free under %s): each miss makes its "
                                "unit again", what, need / 2**30, free / 2**30, folder)
                    return None
                _build(path, fp, keys, unit_nbytes, stride, make_unit, what, checksum)
            with open(path, "rb") as f:
                meta = _read_meta(f)
            return UnitSpill(path, keys, unit_nbytes, stride, meta["data_offset"], meta["checksum"], meta["crc32"])
    except OSError as err:
        log.warning("%s: cannot use %s (%s): each miss makes its unit again", what, folder, err.strerror or err)
        return None


def _header(fp: str, keys: Sequence[Key], unit_nbytes: int, stride: int, crcs: list[int], data_offset: int,
            checksum_name: str) -> bytes:
    meta = json.dumps({"version": 2, "fingerprint": fp, "unit_nbytes": unit_nbytes, "stride": stride,
                       "count": len(keys), "keys_digest": _keys_digest(keys), "data_offset": data_offset,
                       "checksum": checksum_name, "crc32": crcs}).encode()
    body = MAGIC + struct.pack("<Q", len(meta)) + meta + struct.pack("<I", zlib.crc32(meta))
    return body + b"\0" * (_round_up(len(body), ALIGN) - len(body))


def _keys_digest(keys: Sequence[Key]) -> str:
    return hashlib.sha256(repr(list(keys)).encode()).hexdigest()[:16]


def _read_meta(f) -> dict:  # noqa: ANN001 - a binary file
    head = f.read(len(MAGIC) + 8)
    if len(head) < len(MAGIC) + 8 or head[: len(MAGIC)] != MAGIC:
        raise ValueError("not a spill file (bad magic)")
    (n,) = struct.unpack("<Q", head[len(MAGIC) :])
    if n > 64 * 2**20:
        raise ValueError("header length out of range")
    meta = f.read(n)
    crc = f.read(4)
    if len(meta) != n or len(crc) != 4 or struct.unpack("<I", crc)[0] != zlib.crc32(meta):
        raise ValueError("header checksum mismatch")
    data = json.loads(meta)
    if not isinstance(data, dict) or not isinstance(data.get("data_offset"), int):
        raise ValueError("header without a data offset")
    return data


def _check(path: Path, fp: str, keys: Sequence[Key], unit_nbytes: int, stride: int) -> str | None:
    """None if `path` is a complete spill file for exactly these units, else why not."""
    if not path.is_file():
        return "missing"
    try:
        with open(path, "rb") as f:
            meta = _read_meta(f)
            data_offset = meta["data_offset"]
            if meta.get("fingerprint") != fp:
                return "made from another checkpoint or layout"
            expected = {"version": 2, "unit_nbytes": unit_nbytes, "stride": stride, "count": len(keys),
                        "keys_digest": _keys_digest(keys)}
            for name, value in expected.items():
                if meta.get(name) != value:
                    return f"{name} is {meta.get(name)}, expected {value}"
            if checksum_named(str(meta.get("checksum"))) is None:  # kernels=torch reads a file the C++ op made
                return f"its checksum {meta.get('checksum')} cannot be computed here"
            crcs = meta.get("crc32")
            if not isinstance(crcs, list) or len(crcs) != len(keys) or not all(isinstance(c, int) for c in crcs):
                return "per-unit checksums missing"
            size = path.stat().st_size
            if size != data_offset + len(keys) * stride:
                return f"size {size} bytes, expected {data_offset + len(keys) * stride} (truncated?)"
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    except (OSError, ValueError) as err:
        return str(err)
    return None


def _build(path: Path, fp: str, keys: Sequence[Key], unit_nbytes: int, stride: int,
           make_unit: Callable[[Key, torch.Tensor], None], what: str, checksum: Checksum) -> None:
    """Write every unit to a temporary file, then its header, then rename it into place. One unit in memory."""
    t0 = time.monotonic()
    log.info("%s: writing %d units (%.2f GiB) once to %s", what, len(keys), len(keys) * stride / 2**30, path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    # The header is written last (the CRCs are known then): reserve room for the widest CRCs.
    data_offset = _round_up(len(_header(fp, keys, unit_nbytes, stride, [2**32 - 1] * len(keys), 2**62,
                                        checksum.name)), ALIGN)
    buf = torch.zeros(stride, dtype=torch.uint8)
    unit = buf[:unit_nbytes]
    crcs: list[int] = []
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        offset, since_sync = data_offset, 0
        view = memoryview(buf.numpy())  # type: ignore[arg-type]
        for key in keys:
            make_unit(key, unit)
            crcs.append(checksum.fn(unit))
            done = 0
            while done < stride:
                done += os.pwrite(fd, view[done:], offset + done)
            offset += stride
            since_sync += stride
            if since_sync >= _SYNC_EVERY_BYTES:
                os.fdatasync(fd)
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                since_sync = 0
        header = _header(fp, keys, unit_nbytes, stride, crcs, data_offset, checksum.name)
        os.pwrite(fd, header + b"\0" * (data_offset - len(header)), 0)
        os.fdatasync(fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, path)
    log.info("%s: wrote %s in %.1f s", what, path, time.monotonic() - t0)
