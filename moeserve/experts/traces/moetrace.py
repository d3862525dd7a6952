"""Routing traces: which experts each token used in each MoE layer, one forward step at a time.

The engine writes one with ``--record-trace FILE``; the cache simulator (`moeserve.bench.simulate`) replays
it. The byte layout is specified in ``docs/trace-format.md``; in short::

    b"MOETRACE" | version u16 | header_len u32 | header JSON (utf-8)
    then records, each starting with a type byte:
      0x01 LAYER      layer u16 | tokens u32 | k u16 | tokens*k expert ids u16     (row-major [tokens, k])
      0x02 PREDICTED  layer u16 | tokens u32 | k u16 | tokens*k expert ids u16     (prediction FOR `layer`)
      0x03 END_STEP

All integers are little-endian. There is no footer or index, so a writer only ever appends; a file cut short
by a crash reads back up to its last whole record.
"""

from __future__ import annotations

import contextlib
import json
import logging
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

import numpy as np

from moeserve.errors import MoeserveError

log = logging.getLogger("moeserve")

MAGIC = b"MOETRACE"
VERSION = 1
MAX_EXPERTS = 1 << 16  # expert ids are stored as uint16

REC_LAYER = 0x01
REC_PREDICTED = 0x02
REC_END_STEP = 0x03

_PREAMBLE = struct.Struct("<8sHI")  # magic, version, header_len
_LAYER_HEAD = struct.Struct("<HIH")  # layer, tokens, k (follows the type byte)
_MAX_HEADER_BYTES = 1 << 20


class TraceError(MoeserveError):
    """A trace file that is missing, not a moeserve trace, corrupt, or inconsistent with its header."""


@dataclass(frozen=True)
class TraceHeader:
    """What a trace is about. ``moe_layers`` are the model's MoE layer indices, in forward order."""

    model: str
    num_layers: int
    num_experts: int
    top_k: int
    moe_layers: tuple[int, ...]
    extra: Mapping[str, Any] = field(default_factory=dict)  # free-form provenance (source, notes)

    def __post_init__(self) -> None:
        if not 0 < self.num_experts <= MAX_EXPERTS:
            raise TraceError(f"trace header: num_experts={self.num_experts} must be in 1..{MAX_EXPERTS}")
        if self.top_k < 1:
            raise TraceError(f"trace header: top_k={self.top_k} must be >= 1")
        if not self.moe_layers or len(set(self.moe_layers)) != len(self.moe_layers):
            raise TraceError(f"trace header: moe_layers={list(self.moe_layers)} must be non-empty and unique")
        if any(not 0 <= layer < self.num_layers for layer in self.moe_layers):
            raise TraceError(f"trace header: moe_layers must lie in 0..{self.num_layers - 1}")

    def next_moe_layer(self, layer: int) -> int:
        """The MoE layer that runs after ``layer`` (the first one of the next step after the last)."""
        pos = self.moe_layers.index(layer)
        return self.moe_layers[(pos + 1) % len(self.moe_layers)]

    def to_json(self) -> dict[str, Any]:
        return {
            "format": "moeserve-trace",
            "model": self.model,
            "num_layers": self.num_layers,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "moe_layers": list(self.moe_layers),
            "extra": dict(self.extra),
        }

    @classmethod
    def from_json(cls, data: Any, source: str) -> TraceHeader:
        try:
            return cls(
                model=str(data["model"]),
                num_layers=int(data["num_layers"]),
                num_experts=int(data["num_experts"]),
                top_k=int(data["top_k"]),
                moe_layers=tuple(int(x) for x in data["moe_layers"]),
                extra=dict(data.get("extra", {})),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise TraceError(f"{source}: bad trace header ({err!r}); was it written by moeserve?") from err


@dataclass(frozen=True)
class LayerRecord:
    """One MoE layer call of one step. ``predicted`` is a prediction recorded for the NEXT MoE layer."""

    layer: int
    topk_ids: np.ndarray  # [tokens, k] uint16
    predicted: np.ndarray | None = None  # [tokens', k'] uint16, experts predicted for `predicted_layer`
    predicted_layer: int | None = None

    def unique_experts(self) -> list[int]:
        """The set this layer asks the expert store for, ascending."""
        return np.unique(self.topk_ids).tolist()


Step = list[LayerRecord]


class TraceWriter:
    """Appends routing records to a trace file. Use as a context manager, or call `close()`.

    Per forward step: one `record()` per MoE layer, in forward order, then `end_step()`.
    ``append=True`` continues an existing file whose header must equal ``header``.
    """

    def __init__(self, path: str | Path, header: TraceHeader, *, append: bool = False) -> None:
        self.path = Path(path)
        self.header = header
        self._moe_layers = frozenset(header.moe_layers)
        if append and self.path.exists() and self.path.stat().st_size > 0:
            existing = read_trace(self.path).header
            if existing.to_json() != header.to_json():
                raise TraceError(f"{self.path}: cannot append, the file's header differs from this trace's")
            self._file: BinaryIO = open(self.path, "ab")  # noqa: SIM115 - closed by close()
        else:
            self._file = open(self.path, "wb")  # noqa: SIM115
            blob = json.dumps(header.to_json(), separators=(",", ":")).encode()
            self._file.write(_PREAMBLE.pack(MAGIC, VERSION, len(blob)) + blob)

    def record(
        self,
        layer: int,
        topk_ids: Sequence[Sequence[int]] | np.ndarray,
        predicted_next: Sequence[Sequence[int]] | Sequence[int] | np.ndarray | None = None,
    ) -> None:
        """Record the experts each token chose in ``layer``: ``topk_ids`` is [tokens, k] (int, any dtype).

        ``predicted_next`` optionally records the experts predicted (before they were known) for the next MoE
        layer: [tokens, k'] or a flat list of expert ids. No per-token Python loop for numpy input.
        """
        if layer not in self._moe_layers:
            raise TraceError(f"record(layer={layer}): not one of the header's moe_layers")
        self._write_ids(REC_LAYER, layer, topk_ids)
        if predicted_next is not None:
            self._write_ids(REC_PREDICTED, self.header.next_moe_layer(layer), predicted_next)

    def end_step(self) -> None:
        """Mark the end of one forward step (every MoE layer ran once)."""
        self._file.write(bytes((REC_END_STEP,)))

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _write_ids(self, rec_type: int, layer: int, ids: Any) -> None:
        arr = checked_ids(ids, layer, self.header.num_experts)
        tokens, k = arr.shape
        payload = np.ascontiguousarray(arr, dtype="<u2").tobytes()
        self._file.write(bytes((rec_type,)) + _LAYER_HEAD.pack(layer, tokens, k) + payload)


class FailSafeWriter:
    """Wraps a trace writer (`record` / `end_step` / `close`) as a side channel: the first OSError it raises (a
    full disk: ENOSPC, a removed mount: EIO) disables recording with one error log line, and the step that hit it
    goes on. Without this a full disk under --record-trace failed every step and the engine stopped serving.
    `on_disable` runs once when that happens (the engine drops its routing hook)."""

    def __init__(self, writer: Any, path: str | Path, on_disable: Callable[[], None] | None = None) -> None:
        self._writer, self.path, self._on_disable = writer, Path(path), on_disable
        self.disabled = False

    def record(self, layer: int, topk_ids: Any, predicted_next: Any = None) -> None:
        if not self.disabled:
            try:
                self._writer.record(layer, topk_ids, predicted_next)
            except OSError as err:
                self._disable(err)

    def end_step(self) -> None:
        if not self.disabled:
            try:
                self._writer.end_step()
            except OSError as err:
                self._disable(err)

    def close(self) -> None:
        if self.disabled:
            return
        try:
            self._writer.close()
        except OSError as err:
            self._disable(err)

    def _disable(self, err: OSError) -> None:
        self.disabled = True
        log.error("record_trace: writing %s failed (%s); routing is no longer recorded, serving goes on (the file "
                  "ends at the last whole record before the failure, or earlier)", self.path, err.strerror or err)
        with contextlib.suppress(OSError):
            self._writer.close()  # a full disk may refuse the last flush too
        if self._on_disable is not None:
            self._on_disable()


def checked_ids(ids: Any, layer: int, num_experts: int) -> np.ndarray:
    """Expert ids a writer was given -> an integer array [tokens, k] (a flat set of ids is one row), each id in
    ``0..num_experts-1``; `TraceError` otherwise."""
    arr = np.asarray(ids)
    if arr.ndim == 1:
        arr = arr.reshape(1, -1)
    if arr.ndim != 2 or (arr.size and arr.dtype.kind not in "iu"):
        raise TraceError(f"layer {layer}: expert ids must be an integer array [tokens, k], got {arr.shape}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= num_experts):
        raise TraceError(f"layer {layer}: expert id out of range 0..{num_experts - 1}")
    return arr


class Trace:
    """A trace file opened for reading: ``header`` plus iteration over steps (re-reads the file each time)."""

    def __init__(self, path: Path, header: TraceHeader, data_offset: int) -> None:
        self.path = path
        self.header = header
        self._data_offset = data_offset

    def __iter__(self) -> Iterator[Step]:
        with open(self.path, "rb") as f:
            f.seek(self._data_offset)
            yield from _read_steps(f, self.path, self.header)

    def steps(self) -> list[Step]:
        return list(self)


def read_trace(path: str | Path) -> Trace:
    """Open a trace file and validate its preamble and header. Records are read lazily by iterating."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: no such trace file")
    with open(path, "rb") as f:
        pre = f.read(_PREAMBLE.size)
        if len(pre) < _PREAMBLE.size or pre[:8] != MAGIC:
            raise TraceError(f"{path}: not a moeserve trace (bad magic; expected {MAGIC!r})")
        _, version, header_len = _PREAMBLE.unpack(pre)
        if version != VERSION:
            raise TraceError(f"{path}: trace format version {version}, this moeserve reads version {VERSION}")
        if header_len > _MAX_HEADER_BYTES:
            raise TraceError(f"{path}: header length {header_len} bytes is implausible; the file is corrupt")
        blob = f.read(header_len)
        if len(blob) != header_len:
            raise TraceError(f"{path}: file ends inside the header; it is truncated")
        try:
            data = json.loads(blob.decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise TraceError(f"{path}: trace header is not valid JSON ({err})") from err
    header = TraceHeader.from_json(data, str(path))
    return Trace(path, header, _PREAMBLE.size + header_len)


def _read_steps(f: BinaryIO, path: Path, header: TraceHeader) -> Iterator[Step]:
    step: Step = []
    moe_layers = frozenset(header.moe_layers)
    while True:
        offset = f.tell()
        tag = f.read(1)
        if not tag:
            break
        rec_type = tag[0]
        if rec_type == REC_END_STEP:
            yield step
            step = []
            continue
        if rec_type not in (REC_LAYER, REC_PREDICTED):
            raise TraceError(
                f"{path}: unknown record type {rec_type:#04x} at byte {offset}; the file is corrupt"
            )
        head = f.read(_LAYER_HEAD.size)
        if len(head) < _LAYER_HEAD.size:
            break  # a record cut short by a crash while writing: keep what came before
        layer, tokens, k = _LAYER_HEAD.unpack(head)
        nbytes = 2 * tokens * k
        raw = f.read(nbytes)
        if len(raw) < nbytes:
            break
        if layer not in moe_layers:
            raise TraceError(f"{path}: record at byte {offset} names layer {layer}, not an MoE layer")
        ids = np.frombuffer(raw, dtype="<u2").reshape(tokens, k)
        if ids.size and int(ids.max()) >= header.num_experts:
            raise TraceError(f"{path}: record at byte {offset} has an expert id >= {header.num_experts}")
        if rec_type == REC_LAYER:
            step.append(LayerRecord(layer=layer, topk_ids=ids))
        elif not step:
            raise TraceError(f"{path}: prediction at byte {offset} does not follow a layer record")
        else:
            last = step[-1]
            step[-1] = LayerRecord(last.layer, last.topk_ids, predicted=ids, predicted_layer=layer)
    if step:
        yield step  # records after the last END_STEP (a run that stopped mid-step)
