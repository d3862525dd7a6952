"""Every routing-trace format moeserve reads, behind one loader, and the converters between them.

Formats (``docs/trace-format.md``): ``moetrace``, the engine's binary trace (`moeserve.experts.traces.moetrace`); ``jsonl``,
the plain interchange format (`moeserve.experts.traces.jsonl`); ``flame``, a folder of FLAME-MoE routing CSVs
(`moeserve.bench.flame`). All read into the same header + steps, so the simulator and the converters never
branch on where a trace came from.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from moeserve.bench.flame import load_flame, write_flame
from moeserve.experts.traces.jsonl import file_format, read_jsonl_trace, write_trace_file
from moeserve.experts.traces.moetrace import Step, TraceError, TraceHeader, read_trace

INPUT_FORMATS = ("auto", "moetrace", "jsonl", "flame")
OUTPUT_FORMATS = ("jsonl", "moetrace", "flame")
T = TypeVar("T")


@dataclass
class LoadedTrace:
    """A trace of any format. ``steps`` may be lazy (a binary trace re-reads its file on each pass)."""

    header: TraceHeader
    steps: Iterable[Step]
    fmt: str  # the format it was read as
    notes: list[str] = field(default_factory=list)  # header fields inferred, one line each


def detect_format(path: str | Path) -> str:
    """``flame`` for a folder, else the file's format from its content (`file_format`)."""
    return "flame" if Path(path).is_dir() else file_format(path)


def load_trace(path: str | Path, fmt: str = "auto") -> LoadedTrace:
    """Read ``path`` as ``fmt`` (one of `INPUT_FORMATS`; ``auto`` detects it from the content)."""
    if fmt not in INPUT_FORMATS:
        raise TraceError(f"trace format {fmt!r}: choose one of {', '.join(INPUT_FORMATS)}")
    fmt = detect_format(path) if fmt == "auto" else fmt
    if fmt == "flame":
        header, steps = load_flame(path)
        return LoadedTrace(header, steps, fmt)
    if fmt == "jsonl":
        trace = read_jsonl_trace(path)
        return LoadedTrace(trace.header, trace.steps, fmt, [f"header: inferred {note}" for note in trace.inferred])
    binary = read_trace(path)
    return LoadedTrace(binary.header, binary, fmt)


def write_trace(dest: str | Path, header: TraceHeader, steps: Iterable[Step], fmt: str) -> int:
    """Write ``steps`` as ``fmt`` (one of `OUTPUT_FORMATS`); returns how many steps were written."""
    if fmt not in OUTPUT_FORMATS:
        raise TraceError(f"output format {fmt!r}: choose one of {', '.join(OUTPUT_FORMATS)}")
    if fmt == "flame":
        return write_flame(dest, header, steps)
    return write_trace_file(dest, header, steps, fmt)


def convert(
    source: str | Path, dest: str | Path, to: str = "jsonl", source_fmt: str = "auto"
) -> tuple[LoadedTrace, int]:
    """Convert the trace at ``source`` to ``to`` at ``dest``: what was read (header, format, notes) and the
    number of steps written."""
    if Path(source).resolve() == Path(dest).resolve():
        raise TraceError(f"{dest}: the output would overwrite the input")
    trace = load_trace(source, source_fmt)
    return trace, write_trace(dest, trace.header, trace.steps, to)


def shuffled(steps: list[T], warmup_fraction: float, seed: int) -> list[T]:
    """`steps` with the fitting part (the first `warmup_fraction`, the simulator's split) and the evaluated part
    each permuted at random, steps kept whole: the permutation test of `moeserve trace shuffle`."""
    split = int(len(steps) * warmup_fraction)
    rng = random.Random(seed)
    fit, evaluated = steps[:split], steps[split:]
    rng.shuffle(fit)
    rng.shuffle(evaluated)
    return fit + evaluated
