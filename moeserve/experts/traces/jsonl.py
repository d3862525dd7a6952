"""The JSON-lines routing trace: the plain interchange format (spec: ``docs/trace-format.md``).

One JSON object per line, one line per MoE layer call::

    {"num_layers": 10, "num_experts": 64, "top_k": 6, "moe_layers": [2, 3, 4]}    optional header, first line
    {"step": 0, "layer": 2, "experts": [[34, 28, 21, 47, 3, 12]]}                 token 0's experts in layer 2
    {"step": 0, "layer": 3, "experts": [[5, 1, 9, 60, 7, 2]], "predicted": [[4, 8]]}

A step is one forward pass of the batch (``step`` never decreases); ``experts`` holds one row of ``top_k`` ids
per token of the batch. Header fields that are absent are inferred from the records, and the reader says which.
Every error names the line. The records read into the same `Step` lists as the binary format's
(`moeserve.experts.traces.moetrace`), so everything downstream is shared.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

import numpy as np

from moeserve.experts.traces.moetrace import (
    MAGIC,
    MAX_EXPERTS,
    LayerRecord,
    Step,
    TraceError,
    TraceHeader,
    TraceWriter,
    checked_ids,
    read_trace,
)

HEADER_KEYS = ("model", "num_layers", "num_experts", "top_k", "moe_layers", "extra")
RECORD_KEYS = ("step", "layer", "experts", "predicted")
WRITER_FORMATS = ("moetrace", "jsonl")  # what the engine's record_trace can write


@dataclass
class JsonlTrace:
    """A JSON-lines trace read and validated in full. ``inferred``: one note per header field not in the file."""

    header: TraceHeader
    steps: list[Step]
    inferred: list[str]


@dataclass
class _Record:
    line: int
    step: int
    layer: int
    experts: np.ndarray  # [tokens, top_k] uint16
    predicted: np.ndarray | None  # [tokens', k'] uint16, for the next MoE layer


class JsonlTraceWriter:
    """Writes a JSON-lines trace with the same calls as `TraceWriter`: per forward step, one `record()` per MoE
    layer in forward order, then `end_step()`. The header line is written first, every field filled in."""

    def __init__(self, path: str | Path, header: TraceHeader) -> None:
        self.path = Path(path)
        self.header = header
        self._moe_layers = frozenset(header.moe_layers)
        self._step = 0
        self._file: TextIO = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 - closed by close()
        fields = header.to_json()
        self._write({key: fields[key] for key in HEADER_KEYS if key != "extra" or fields[key]})

    def record(self, layer: int, topk_ids: Any, predicted_next: Any = None) -> None:
        """The experts each token chose in ``layer`` ([tokens, k] ints); ``predicted_next``: the experts guessed
        for the next MoE layer before its router ran ([tokens', k'] or a flat list of ids), or None."""
        if layer not in self._moe_layers:
            raise TraceError(f"record(layer={layer}): not one of the header's moe_layers")
        row: dict[str, Any] = {
            "step": self._step,
            "layer": int(layer),
            "experts": checked_ids(topk_ids, layer, self.header.num_experts).tolist(),
        }
        if predicted_next is not None:
            row["predicted"] = checked_ids(predicted_next, layer, self.header.num_experts).tolist()
        self._write(row)

    def end_step(self) -> None:
        """The next records belong to the next forward step."""
        self._step += 1

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> JsonlTraceWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _write(self, obj: dict[str, Any]) -> None:
        self._file.write(json.dumps(obj, separators=(",", ":")) + "\n")


def open_trace_writer(path: str | Path, header: TraceHeader, fmt: str = "moetrace") -> TraceWriter | JsonlTraceWriter:
    """A writer of ``fmt`` (one of `WRITER_FORMATS`): both take the same `record` / `end_step` / `close` calls."""
    if fmt == "jsonl":
        return JsonlTraceWriter(path, header)
    if fmt == "moetrace":
        return TraceWriter(path, header)
    raise TraceError(f"trace format {fmt!r}: choose one of {', '.join(WRITER_FORMATS)}")


def write_trace_file(path: str | Path, header: TraceHeader, steps: Iterable[Step], fmt: str = "jsonl") -> int:
    """Write ``steps`` (from any reader) as a trace file of ``fmt`` (`WRITER_FORMATS`); returns the steps written.
    (A step with no layer call has no line in a JSON-lines trace: it is lost there.)"""
    count = 0
    with open_trace_writer(path, header, fmt) as writer:
        for step in steps:
            for rec in step:
                writer.record(rec.layer, rec.topk_ids, rec.predicted)
            writer.end_step()
            count += 1
    return count


def file_format(path: str | Path) -> str:
    """``moetrace`` for a file that starts with the binary magic, ``jsonl`` for one whose first non-blank
    character is ``{``; `TraceError` for anything else."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: no such trace file")
    with open(path, "rb") as f:
        head = f.read(4096)
    if head.startswith(MAGIC):
        return "moetrace"
    if head.lstrip().startswith(b"{"):
        return "jsonl"
    raise TraceError(
        f"{path}: not a routing trace (bad magic: neither {MAGIC!r} nor a JSON line starting with '{{'); "
        "see docs/trace-format.md"
    )


def read_trace_file(path: str | Path) -> tuple[TraceHeader, Iterable[Step], list[str]]:
    """A binary or JSON-lines trace file (`file_format`) -> its header, its steps (lazy for a binary trace) and
    one note per header field that was inferred."""
    if file_format(path) == "moetrace":
        binary = read_trace(path)
        return binary.header, binary, []
    trace = read_jsonl_trace(path)
    return trace.header, trace.steps, trace.inferred


def read_jsonl_trace(path: str | Path) -> JsonlTrace:
    """Read and validate a JSON-lines trace. Raises `TraceError` naming the line of the first problem."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: no such trace file")
    given: dict[str, Any] = {}
    records: list[_Record] = []
    top_k: tuple[int, int] | None = None  # (experts per token, line) from the header or the first line with tokens
    with open(path, encoding="utf-8") as f:
        try:
            for number, text in enumerate(f, start=1):
                if not text.strip():
                    continue  # blank lines carry nothing
                obj = _parse_line(path, number, text)
                if "step" not in obj and number == 1:
                    given = _check_header(path, obj)
                    top_k = (given["top_k"], 1) if "top_k" in given else None
                    continue
                rec = _parse_record(path, number, obj, given, records[-1] if records else None, top_k)
                if top_k is None and rec.experts.size:
                    top_k = (rec.experts.shape[1], number)  # later lines must agree
                records.append(rec)
        except UnicodeDecodeError as err:
            raise TraceError(f"{path}: not UTF-8 text ({err}); is it a binary trace?") from err
    header, inferred = _complete_header(path, given, records)
    return JsonlTrace(header, _group_steps(path, header, records), inferred)


def _parse_line(path: Path, number: int, text: str) -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        hint = "; the file ends inside this line (a run cut short?)" if not text.endswith("\n") else ""
        raise TraceError(f"{path}:{number}: not valid JSON ({err.msg} at column {err.colno}){hint}") from err
    if not isinstance(obj, dict):
        raise TraceError(f"{path}:{number}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _unknown_keys(path: Path, number: int, obj: dict[str, Any], allowed: tuple[str, ...], what: str) -> None:
    for key in obj:
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}?" if close else f"allowed: {', '.join(allowed)}"
            raise TraceError(f"{path}:{number}: unknown {what} key {key!r} ({hint})")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_header(path: Path, obj: dict[str, Any]) -> dict[str, Any]:
    """The first line, when it has no ``step``: header fields, each checked for its type."""
    _unknown_keys(path, 1, obj, HEADER_KEYS, "header")
    for key in ("num_layers", "num_experts", "top_k"):
        if key in obj and not (_is_int(obj[key]) and obj[key] >= 1):
            raise TraceError(f"{path}:1: header {key}={obj[key]!r} must be an integer >= 1")
    layers = obj.get("moe_layers")
    if layers is not None and not (isinstance(layers, list) and all(_is_int(x) and x >= 0 for x in layers)):
        raise TraceError(f"{path}:1: header moe_layers={layers!r} must be a list of integers >= 0")
    if "model" in obj and not isinstance(obj["model"], str):
        raise TraceError(f"{path}:1: header model={obj['model']!r} must be a string")
    if "extra" in obj and not isinstance(obj["extra"], dict):
        raise TraceError(f"{path}:1: header extra must be an object")
    if obj.get("num_experts", 0) > MAX_EXPERTS:
        raise TraceError(f"{path}:1: header num_experts={obj['num_experts']} is above {MAX_EXPERTS}")
    return obj


def _parse_record(
    path: Path, number: int, obj: dict[str, Any], given: dict[str, Any], last: _Record | None,
    top_k: tuple[int, int] | None,
) -> _Record:
    """One layer-call line, checked on its own, against the header fields given, the line before, and ``top_k``
    (experts per token, and the line that set it: 1 for the header)."""
    where = f"{path}:{number}"
    _unknown_keys(path, number, obj, RECORD_KEYS, "record")
    for key in ("step", "layer", "experts"):
        if key not in obj:
            first = " (only the first line may be a header)" if key == "step" else ""
            raise TraceError(f"{where}: missing {key!r}{first}")
    step, layer = obj["step"], obj["layer"]
    if not (_is_int(step) and step >= 0) or not (_is_int(layer) and layer >= 0):
        raise TraceError(f"{where}: step and layer must be integers >= 0, got step={step!r} layer={layer!r}")
    if last is not None and step < last.step:
        raise TraceError(f"{where}: step {step} after step {last.step} (steps must not decrease)")
    if "moe_layers" in given and layer not in given["moe_layers"]:
        raise TraceError(f"{where}: layer {layer} is not in the header's moe_layers {given['moe_layers']}")
    if "num_layers" in given and layer >= given["num_layers"]:
        raise TraceError(f"{where}: layer {layer} >= the header's num_layers={given['num_layers']}")
    experts = _id_rows(where, "experts", obj["experts"], given.get("num_experts"))
    if experts.size and top_k is not None and experts.shape[1] != top_k[0]:
        origin = "in the header" if "top_k" in given else f"from line {top_k[1]}"
        raise TraceError(f"{where}: {experts.shape[1]} experts per token, but top_k is {top_k[0]} ({origin})")
    if any(len(set(row)) != len(row) for row in experts.tolist()):
        raise TraceError(f"{where}: a token lists the same expert twice")
    predicted = None
    if obj.get("predicted") is not None:
        predicted = _id_rows(where, "predicted", obj["predicted"], given.get("num_experts"))
    return _Record(number, step, layer, experts, predicted)


def _id_rows(where: str, key: str, value: Any, num_experts: int | None) -> np.ndarray:
    """``[[id, ...], ...]`` -> [rows, k] uint16, every row the same length, every id in range."""
    if not isinstance(value, list) or not all(isinstance(row, list) for row in value):
        raise TraceError(f"{where}: {key!r} must be a list of lists of expert ids, one list per token")
    if len({len(row) for row in value}) > 1:
        raise TraceError(f"{where}: {key!r}: tokens list different numbers of experts")
    if not all(_is_int(e) for row in value for e in row):
        raise TraceError(f"{where}: {key!r}: expert ids must be integers")
    limit = num_experts or MAX_EXPERTS
    bad = [e for row in value for e in row if not 0 <= e < limit]
    if bad:
        source = "header's num_experts" if num_experts else "format's limit"
        raise TraceError(f"{where}: expert id {bad[0]} out of range 0..{limit - 1} (the {source})")
    width = len(value[0]) if value else 0
    return np.array(value, dtype=np.uint16).reshape(len(value), width)


def _complete_header(path: Path, given: dict[str, Any], records: list[_Record]) -> tuple[TraceHeader, list[str]]:
    """The header, its missing fields inferred from the records (one note per inferred field)."""
    inferred = []
    fields = dict(given)
    needed = [key for key in ("num_experts", "top_k", "moe_layers") if key not in fields]
    if needed and not records:
        raise TraceError(f"{path}: no layer calls to infer {', '.join(needed)} from")
    if "model" not in fields:
        fields["model"] = path.stem
    if "num_experts" not in fields:
        fields["num_experts"] = 1 + max(
            max(int(r.experts.max(initial=0)), int(r.predicted.max(initial=0)) if r.predicted is not None else 0)
            for r in records
        )
        inferred.append(f"num_experts={fields['num_experts']} (largest expert id + 1; the model may have more)")
    if "top_k" not in fields:
        widths = [r.experts.shape[1] for r in records if r.experts.size]
        fields["top_k"] = widths[0] if widths else 1
        inferred.append(f"top_k={fields['top_k']} (experts per token)")
    if "moe_layers" not in fields:
        fields["moe_layers"] = sorted({r.layer for r in records})
        inferred.append(f"moe_layers={fields['moe_layers']} (the layers seen, ascending)")
    if "num_layers" not in fields:
        fields["num_layers"] = max(fields["moe_layers"]) + 1
        inferred.append(f"num_layers={fields['num_layers']} (last MoE layer + 1)")
    try:
        header = TraceHeader(
            model=fields["model"], num_layers=fields["num_layers"], num_experts=fields["num_experts"],
            top_k=fields["top_k"], moe_layers=tuple(fields["moe_layers"]), extra=fields.get("extra", {}),
        )
    except TraceError as err:
        raise TraceError(f"{path}:1: {err}") from err
    return header, inferred


def _group_steps(path: Path, header: TraceHeader, records: list[_Record]) -> list[Step]:
    """Consecutive records of one ``step`` value form one step; a layer may run once per step."""
    steps: list[Step] = []
    seen: set[int] = set()
    for i, rec in enumerate(records):
        if i == 0 or rec.step != records[i - 1].step:
            steps.append([])
            seen = set()
        if rec.layer in seen:
            raise TraceError(
                f"{path}:{rec.line}: layer {rec.layer} twice in step {rec.step} (a step is one forward pass: "
                "each MoE layer runs once; the next pass needs the next step number)"
            )
        seen.add(rec.layer)
        predicted_layer = header.next_moe_layer(rec.layer) if rec.predicted is not None else None
        experts = rec.experts if rec.experts.size else rec.experts.reshape(0, header.top_k)  # [] has no width
        steps[-1].append(LayerRecord(rec.layer, experts, rec.predicted, predicted_layer))
    return steps
