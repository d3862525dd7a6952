"""One GGUF file's header: metadata key/values and tensor infos, read and validated without touching the data.

Layout (GGUF v2/v3, little-endian): magic ``GGUF``, u32 version, u64 tensor count, u64 key/value count; each key a
string (u64 length + UTF-8 bytes), a u32 value type and the value (arrays: u32 element type, u64 count, elements);
then each tensor's name, u32 dims, u64 per dim (innermost first: ggml's ne[0] is the input features), u32 ggml type,
u64 offset from the data section; the data section starts at the next multiple of ``general.alignment`` (32).

Bounded like the safetensors header (checkpoint/safetensors_file.py): strings, arrays, dims and counts have limits a
real file never reaches, every tensor's byte range must lie inside the file and not overlap another, and every
problem is one `CheckpointError` line naming the file (and key or tensor).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from moeserve.checkpoint.gguf.quants import GGML_TYPES, GGMLType
from moeserve.errors import CheckpointError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_STRING_BYTES = 64 * 2**20  # a chat template is kilobytes; tokenizer.ggml.merges entries are bytes each
MAX_ARRAY_ITEMS = 16 * 2**20  # vocabularies are ~250k tokens
MAX_TENSORS = 2**20
MAX_KEYS = 2**16
MAX_DIMS = 4  # ggml tensors have at most 4 dims
MAX_HEADER_BYTES = 512 * 2**20  # a header bigger than this is not a model's

# value type id -> (struct format, size); 8 = string, 9 = array
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4), 6: ("<f", 4),
            7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the header declares it: HF orientation (outermost first), its ggml type, absolute byte range."""

    name: str
    shape: tuple[int, ...]  # reversed ggml ne: [E, out, in] for a layer's stacked experts
    ggml_type: GGMLType
    offset: int  # absolute, in `path`
    nbytes: int
    path: Path


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    data_start: int


class _Reader:
    """Sequential reads of the header with a running byte count (nothing past the tensor infos is read)."""

    def __init__(self, f: BinaryIO, path: Path, size: int) -> None:
        self.f, self.path, self.size, self.pos = f, path, size, 0

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > min(self.size, MAX_HEADER_BYTES):
            raise CheckpointError(f"{self.path}: truncated GGUF header (reading {what} at byte {self.pos})")
        data = self.f.read(n)
        if len(data) != n:
            raise CheckpointError(f"{self.path}: truncated GGUF header (reading {what} at byte {self.pos})")
        self.pos += n
        return data

    def scalar(self, fmt: str, size: int, what: str) -> Any:
        return struct.unpack(fmt, self.take(size, what))[0]

    def u32(self, what: str) -> int:
        return int(self.scalar("<I", 4, what))

    def u64(self, what: str) -> int:
        return int(self.scalar("<Q", 8, what))

    def string(self, what: str) -> str:
        n = self.u64(what)
        if n > MAX_STRING_BYTES:
            raise CheckpointError(f"{self.path}: {what} is {n} bytes long, more than the {MAX_STRING_BYTES} allowed")
        try:
            return self.take(n, what).decode("utf-8")
        except UnicodeDecodeError:
            raise CheckpointError(f"{self.path}: {what} is not UTF-8") from None

    def value(self, vtype: int, what: str, nested: bool = False) -> Any:
        if vtype in _SCALARS:
            return self.scalar(*_SCALARS[vtype], what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY and not nested:
            etype, count = self.u32(what), self.u64(what)
            if count > MAX_ARRAY_ITEMS:
                raise CheckpointError(f"{self.path}: {what} holds {count} items, more than {MAX_ARRAY_ITEMS}")
            if etype in _SCALARS:  # one read for the whole array
                fmt, size = _SCALARS[etype]
                return list(struct.unpack(f"<{count}{fmt[1]}", self.take(count * size, what)))
            return [self.value(etype, what, nested=True) for _ in range(count)]
        raise CheckpointError(f"{self.path}: {what} has value type {vtype}, not a GGUF type")


def read_header(path: Path) -> GGUFHeader:
    """Parse and validate the header of the GGUF file `path` (module docstring); reads only the header bytes."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            return _parse(_Reader(f, path, size))
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read ({err.strerror})") from None


def _parse(r: _Reader) -> GGUFHeader:
    if r.take(4, "the magic") != MAGIC:
        raise CheckpointError(f"{r.path}: not a GGUF file (no GGUF magic)")
    version = r.u32("the version")
    if version not in VERSIONS:
        raise CheckpointError(f"{r.path}: GGUF version {version}; moeserve reads versions {VERSIONS}")
    n_tensors, n_keys = r.u64("the tensor count"), r.u64("the key count")
    if n_tensors > MAX_TENSORS or n_keys > MAX_KEYS:
        raise CheckpointError(f"{r.path}: {n_tensors} tensors and {n_keys} keys: more than a model holds")
    metadata: dict[str, Any] = {}
    for i in range(n_keys):
        key = r.string(f"key {i}")
        if key in metadata:
            raise CheckpointError(f"{r.path}: metadata key '{key}' is given twice")
        metadata[key] = r.value(r.u32(f"'{key}'"), f"'{key}'")
    raw = [_tensor_info(r) for _ in range(n_tensors)]
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise CheckpointError(f"{r.path}: general.alignment={alignment!r} is not a power of two")
    data_start = -(-r.pos // alignment) * alignment
    return GGUFHeader(r.path, version, metadata, _place(r, raw, data_start, alignment), data_start)


def _tensor_info(r: _Reader) -> tuple[str, tuple[int, ...], int, int]:
    name = r.string("a tensor name")
    n_dims = r.u32(f"tensor '{name}'")
    if not 1 <= n_dims <= MAX_DIMS:
        raise CheckpointError(f"{r.path}: tensor '{name}' has {n_dims} dims (ggml tensors have 1 to {MAX_DIMS})")
    ne = [r.u64(f"tensor '{name}'") for _ in range(n_dims)]
    return name, tuple(reversed(ne)), r.u32(f"tensor '{name}'"), r.u64(f"tensor '{name}'")


def _place(r: _Reader, raw: list[tuple[str, tuple[int, ...], int, int]], data_start: int, alignment: int
           ) -> dict[str, TensorInfo]:
    """Tensor infos with absolute byte ranges, each checked: a known type, whole blocks per row, inside the file,
    aligned, and no two overlapping."""
    tensors: dict[str, TensorInfo] = {}
    for name, shape, type_id, offset in raw:
        if name in tensors:
            raise CheckpointError(f"{r.path}: tensor '{name}' is declared twice")
        gtype = GGML_TYPES.get(type_id)
        if gtype is None:
            raise CheckpointError(f"{r.path}: tensor '{name}' has ggml type {type_id}, not one ggml defines")
        if shape[-1] % gtype.block_elems:
            raise CheckpointError(f"{r.path}: tensor '{name}' rows of {shape[-1]} values do not hold whole "
                                  f"{gtype.name} blocks of {gtype.block_elems}")
        nbytes = gtype.row_bytes(shape[-1])
        for dim in shape[:-1]:
            nbytes *= dim
        start = data_start + offset
        if offset % alignment or start + nbytes > r.size:
            raise CheckpointError(f"{r.path}: tensor '{name}' ({nbytes} bytes at data offset {offset}) is not "
                                  f"aligned to {alignment} or runs past the end of the {r.size}-byte file")
        tensors[name] = TensorInfo(name, shape, gtype, start, nbytes, r.path)
    spans = sorted(tensors.values(), key=lambda t: t.offset)
    for a, b in zip(spans, spans[1:], strict=False):
        if a.offset + a.nbytes > b.offset:
            raise CheckpointError(f"{r.path}: tensors '{a.name}' and '{b.name}' overlap")
    return tensors
