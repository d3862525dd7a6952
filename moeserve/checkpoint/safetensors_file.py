"""One safetensors file: its header, validated up front, and reads of single tensors by byte range.

Format: u64 little-endian header length N, N bytes of JSON header, then the data. Each header entry gives
``dtype``, ``shape`` and ``data_offsets`` [begin, end) relative to byte 8 + N.

We never map or read the whole file. A tensor is read with ``os.preadv`` straight into a caller-owned buffer
(no intermediate bytes object), and the page cache of what was read is dropped with
``posix_fadvise(DONTNEED)`` so the kernel's cache cannot push the machine past its budget.
Every problem is a `CheckpointError` whose one-line message names the file (and tensor).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import struct
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from moeserve.checkpoint import strict_json
from moeserve.errors import CheckpointError

# safetensors dtype code -> (torch dtype, bytes per element)
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8),
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I16": (torch.int16, 2),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "BOOL": (torch.bool, 1),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1),
    "F8_E8M0": (torch.float8_e8m0fnu, 1),  # power-of-two scales (DeepSeek-V4's FP8 and MXFP4 weights)
}

# The reference implementation allows 100 MB, but parsing a header crafted of tiny JSON values takes ~20x its size
# (1.9 GB measured for 99 MB); 32 MiB keeps that under 0.8 GB and is 3x the header of 100k tensors in one file.
_MAX_HEADER_BYTES = 32 * 2**20
_MAX_DIMS = 16  # no checkpoint tensor has more; a header claiming thousands is corrupt


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor's bytes live: file, absolute byte offset, length, dtype and shape."""

    name: str
    path: Path
    offset: int  # absolute offset in the file
    nbytes: int
    dtype: torch.dtype
    dtype_code: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def row_slice(self, index: int) -> TensorRef:
        """The sub-tensor ``t[index]`` of a tensor stacked along dim 0 (contiguous, so still one byte range)."""
        if not self.shape or not 0 <= index < self.shape[0]:
            raise IndexError(f"{self.name}: index {index} out of range for shape {self.shape}")
        row_bytes = self.nbytes // self.shape[0]
        return TensorRef(
            name=f"{self.name}[{index}]",
            path=self.path,
            offset=self.offset + index * row_bytes,
            nbytes=row_bytes,
            dtype=self.dtype,
            dtype_code=self.dtype_code,
            shape=self.shape[1:],
        )


def parse_header(path: Path) -> dict[str, TensorRef]:
    """Read and validate the header of `path`; returns name -> TensorRef. Reads only the header bytes.

    Refused with a one-line CheckpointError naming the file: a header length past the end of the file (or past
    _MAX_HEADER_BYTES), a header that is not UTF-8 JSON or nests too deeply, __metadata__ that is not strings, a
    tensor named twice, an entry without a known dtype, a shape of non-negative integers or two ordered offsets,
    a byte range that does not hold its shape or runs past the end of the file, and byte ranges that overlap."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(
                    f"{path}: truncated safetensors file ({size} bytes, shorter than its 8-byte header length)"
                )
            (header_len,) = struct.unpack("<Q", head)
            if header_len > _MAX_HEADER_BYTES or 8 + header_len > size:
                raise CheckpointError(
                    f"{path}: broken safetensors header (header length {header_len} runs past the end of the "
                    f"{size}-byte file, or past the {_MAX_HEADER_BYTES}-byte limit moeserve reads); the file is "
                    "truncated or not safetensors"
                )
            raw = f.read(header_len)
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read ({err.strerror})") from None
    try:
        header = strict_json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("not an object")
    except ValueError as err:  # UnicodeDecodeError is one
        raise CheckpointError(f"{path}: broken safetensors header (invalid JSON: {err})") from None

    data_start = 8 + header_len
    refs: dict[str, TensorRef] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise CheckpointError(f"{path}: broken safetensors header (__metadata__ must map strings to strings)")
            continue
        refs[name] = _tensor_ref(path, name, entry, data_start, size)
    _check_no_overlap(path, refs.values())
    return refs


def _ints(value: object, what: str) -> list[int]:
    """`value` as a list of non-negative integers (JSON numbers that are not integers, bools and negative
    numbers refused: int() would round 1.5 and accept -1)."""
    if not isinstance(value, list) or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in value):
        raise ValueError(f"{what} must be a list of non-negative integers, got {str(value)[:80]}")
    return value


def _tensor_ref(path: Path, name: str, entry: object, data_start: int, file_size: int) -> TensorRef:
    try:
        if not isinstance(entry, dict):
            raise ValueError("not an object")
        code = entry.get("dtype")
        shape = tuple(_ints(entry.get("shape"), "shape"))
        if len(shape) > _MAX_DIMS:
            raise ValueError(f"shape has {len(shape)} dimensions (at most {_MAX_DIMS})")
        offsets = _ints(entry.get("data_offsets"), "data_offsets")
        if len(offsets) != 2 or offsets[0] > offsets[1]:
            raise ValueError(f"data_offsets must be [begin, end] with begin <= end, got {offsets}")
        begin, end = offsets
    except ValueError as err:
        raise CheckpointError(f"{path}: broken safetensors header entry for tensor '{name}' ({err})") from None
    if not isinstance(code, str) or code not in DTYPES:
        raise CheckpointError(f"{path}: tensor '{name}' has unsupported dtype {str(code)[:40]}")
    dtype, itemsize = DTYPES[code]
    numel = 1
    for d in shape:
        numel *= d
    if end - begin != numel * itemsize:
        raise CheckpointError(
            f"{path}: tensor '{name}' byte range [{begin}, {end}) does not match shape {list(shape)[:16]} {code}"
        )
    if data_start + end > file_size:
        raise CheckpointError(
            f"{path}: tensor '{name}' byte range runs past the end of the file "
            f"(needs {data_start + end} bytes, file has {file_size}); the file is truncated, download it again"
        )
    return TensorRef(name, path, data_start + begin, end - begin, dtype, code, shape)


def _check_no_overlap(path: Path, refs: Iterable[TensorRef]) -> None:
    """Two tensors sharing bytes is a corrupt header (the reference implementation refuses it too)."""
    spans = sorted((r.offset, r.offset + r.nbytes, r.name) for r in refs if r.nbytes > 0)
    for (_, end, name), (begin, _, other) in zip(spans, spans[1:]):
        if begin < end:
            raise CheckpointError(
                f"{path}: broken safetensors header (tensors '{name}' and '{other}' overlap in the file)"
            )


DIRECT_ALIGN = 4096  # O_DIRECT: file offset, length and buffer address aligned to the device's block size

# Writes one destination (a uint8 tensor) from its stored bytes (a uint8 tensor of the same length), e.g. permuted.
Placer = Callable[[torch.Tensor, torch.Tensor], None]


def _place_all(outs: list[torch.Tensor], stored: torch.Tensor, place: Sequence[Placer | None] | None) -> None:
    """Fill `outs` in order from the consecutive bytes `stored`: each by its placer, or by a plain memcpy (a torch
    copy_ here would start an OpenMP team on the calling I/O thread)."""
    at = 0
    for i, o in enumerate(outs):
        n = o.numel()
        placer = place[i] if place is not None else None
        if placer is None:
            ctypes.memmove(o.data_ptr(), stored.data_ptr() + at, n)
        else:
            placer(o, stored[at : at + n])
        at += n


class FileReader:
    """Reads byte ranges of checkpoint files into caller-owned CPU buffers with pread.

    Keeps one open descriptor per file, and a second one per file for scattered reads (expert misses) with the
    kernel's read-ahead off (``POSIX_FADV_RANDOM``): read-ahead of an 8 MiB window around a 5 MiB expert reads
    bytes nobody asked for. Thread-safe for concurrent reads (pread has no shared file position).

    Scattered reads go through ``O_DIRECT`` where the file system allows it (`direct`): the device writes into an
    aligned per-thread staging buffer and one memcpy moves the exact bytes out. Through the page cache the kernel
    copies every byte and then has to drop the pages: measured here 2.5-3.2 ms of CPU per 4.7 MB expert against
    0.4-0.6 ms with O_DIRECT, at the same disk speed. On a 2-core machine that CPU is taken from the compute
    threads (and from any prefetch), so it sets the offloaded speed. Where O_DIRECT is refused (tmpfs, some
    network file systems) the file falls back to the page-cache path.
    """

    def __init__(self, drop_page_cache: bool = True, direct: bool = True) -> None:
        self._fds: dict[Path, int] = {}
        self._random_fds: dict[Path, int] = {}
        self._direct_fds: dict[Path, int | None] = {}  # None: O_DIRECT refused for this file
        self._fd_lock = threading.Lock()
        self._local = threading.local()  # per thread: (mmap, its address) of the O_DIRECT staging buffer
        self.drop_page_cache = drop_page_cache
        self.direct = direct and hasattr(os, "O_DIRECT")
        self.bytes_read = 0

    def _fd(self, path: Path, scattered: bool = False) -> int:
        fds = self._random_fds if scattered else self._fds
        fd = fds.get(path)
        if fd is None:
            with self._fd_lock:
                fd = fds.get(path)
                if fd is None:
                    try:
                        fd = os.open(path, os.O_RDONLY)
                    except OSError as err:
                        raise CheckpointError(f"{path}: cannot open ({err.strerror})") from None
                    if scattered and hasattr(os, "posix_fadvise"):
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                    fds[path] = fd
        return fd

    def read_into(self, ref: TensorRef, out: torch.Tensor) -> None:
        """Fill `out` (a contiguous CPU tensor of exactly ref.nbytes bytes) with the tensor's bytes."""
        buf = out.view(-1).view(torch.uint8)
        if buf.numel() != ref.nbytes or not out.is_contiguous() or out.device.type != "cpu":
            raise ValueError(f"buffer for {ref.name} must be a contiguous CPU tensor of {ref.nbytes} bytes")
        self._read_run(ref.path, ref.offset, [buf], ref.name, scattered=False)

    def read_run(self, path: Path, offset: int, outs: list[torch.Tensor], what: str,
                 place: Sequence[Placer | None] | None = None) -> None:
        """Fill the contiguous CPU uint8 tensors `outs`, in order, from the byte range of `path` that starts at
        `offset` and is exactly as long as all of them together: ONE ``preadv`` for adjacent tensors (an expert's
        gate, up and down projections), read without read-ahead (O_DIRECT where possible). `what` names the range
        in errors.

        `place[i]` (when given and not None) writes out[i] from its stored bytes, ``place[i](outs[i], stored)``,
        instead of a byte copy (a permutation, say): with O_DIRECT it reads straight from the aligned staging
        buffer, so the bytes are moved once; through the page cache they are read into a per-thread scratch
        buffer first. It must not start OpenMP teams (it runs on I/O threads)."""
        fd = self._direct_fd(path) if self.direct else None
        if fd is not None:
            try:
                self._read_run_direct(fd, path, offset, outs, what, place)
                return
            except OSError as err:
                if err.errno != errno.EINVAL:
                    raise CheckpointError(f"{path}: read error in tensor '{what}' ({err.strerror})") from None
                with self._fd_lock:  # the device wants another alignment: the page cache for this file from now
                    self._direct_fds[path] = None
                os.close(fd)
        if place is None or all(p is None for p in place):
            self._read_run(path, offset, outs, what, scattered=True)
            return
        total = sum(o.numel() for o in outs)
        scratch = self._staging(total)[2][:total]
        self._read_run(path, offset, [scratch], what, scattered=True)
        _place_all(outs, scratch, place)

    def _direct_fd(self, path: Path) -> int | None:
        if path not in self._direct_fds:
            with self._fd_lock:
                if path not in self._direct_fds:
                    try:
                        self._direct_fds[path] = os.open(path, os.O_RDONLY | os.O_DIRECT)
                    except OSError:
                        self._direct_fds[path] = None  # not supported here: page-cache reads
        return self._direct_fds[path]

    def _staging(self, nbytes: int) -> tuple[memoryview, int, torch.Tensor]:
        """This thread's staging buffer (page-aligned, grown when needed): as a memoryview, its address, and as a
        uint8 tensor over the same bytes. O_DIRECT reads land in it; page-cache reads that are placed, too."""
        held = getattr(self._local, "staging", None)
        if held is None or len(held[0]) < nbytes:
            region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            anchor = ctypes.c_char.from_buffer(region)  # exports the buffer: the mapping stays while we hold it
            tensor = torch.frombuffer(region, dtype=torch.uint8)
            held = self._local.staging = (region, anchor, ctypes.addressof(anchor), tensor)
        return memoryview(held[0]), held[2], held[3]

    def _read_run_direct(self, fd: int, path: Path, offset: int, outs: list[torch.Tensor], what: str,
                         place: Sequence[Placer | None] | None) -> None:
        total = sum(o.numel() for o in outs)
        start = offset - offset % DIRECT_ALIGN
        end = -(-(offset + total) // DIRECT_ALIGN) * DIRECT_ALIGN
        view, _, staged = self._staging(end - start)
        done = 0
        while done < offset + total - start:
            n = os.preadv(fd, [view[done : end - start]], start + done)
            if n == 0 or (n % DIRECT_ALIGN and done + n < offset + total - start):
                raise CheckpointError(f"{path}: tensor '{what}' ends early (file truncated while in use?)")
            done += n
        _place_all(outs, staged[offset - start : offset - start + total], place)
        with self._fd_lock:
            self.bytes_read += total

    def _read_run(self, path: Path, offset: int, outs: list[torch.Tensor], what: str, scattered: bool) -> None:
        views = [memoryview(o.numpy()) for o in outs]  # type: ignore[arg-type]
        total = sum(v.nbytes for v in views)
        fd = self._fd(path, scattered)
        done = 0
        while done < total:
            pending, skip = [], done  # the iovecs still to fill, the first one trimmed by what is done
            for v in views:
                if skip >= v.nbytes:
                    skip -= v.nbytes
                    continue
                pending.append(v[skip:])
                skip = 0
            try:
                n = os.preadv(fd, pending, offset + done)
            except OSError as err:
                raise CheckpointError(f"{path}: read error in tensor '{what}' ({err.strerror})") from None
            if n == 0:
                raise CheckpointError(f"{path}: tensor '{what}' ends early (file truncated while in use?)")
            done += n
        with self._fd_lock:
            self.bytes_read += total
        if self.drop_page_cache and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, offset, total, os.POSIX_FADV_DONTNEED)

    def read(self, ref: TensorRef) -> torch.Tensor:
        """A new CPU tensor holding the tensor, in its stored dtype and shape."""
        out = torch.empty(ref.shape, dtype=ref.dtype)
        self.read_into(ref, out)
        return out

    def close(self) -> None:
        for fds in (self._fds, self._random_fds, self._direct_fds):
            for fd in fds.values():
                if fd is not None:
                    os.close(fd)
            fds.clear()

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass
