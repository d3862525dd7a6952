"""Shared start of the one-layer kernel benchmarks (scripts/bench_mamba2_step.py, bench_gated_delta.py): the
--threads flag, the C++ kernels loaded (or exit naming why not), the numerics the layers are built with (C++ ops,
batch-invariant, this CPU's row block), and the ModelSpec of a published config in tests/data/reference_configs."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from moeserve import kernels
from moeserve.models.numerics import Numerics, choose_row_block
from moeserve.models.registry import get_architecture
from moeserve.models.spec import ModelSpec

CONFIGS = Path(__file__).resolve().parents[1] / "tests" / "data" / "reference_configs"


def add_threads_flag(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")


def prepare(args: argparse.Namespace, script: str, config_name: str) -> ModelSpec:
    """Threads set, kernels loaded; the spec of CONFIGS / config_name."""
    if args.threads:
        torch.set_num_threads(args.threads)
    status = kernels.load()
    if not status.available:
        sys.exit(f"{script}: the C++ kernels are not available: {status.reason}")
    path = CONFIGS / config_name
    config = json.loads(path.read_text())
    return get_architecture(config, str(path)).spec(config, str(path))


def bench_numerics() -> Numerics:
    """The numerics of the benchmarked layers: the C++ ops on, batch-invariant, in this CPU's row block."""
    return Numerics(cpp=True, batch_invariant=True, row_block=choose_row_block()[0])


def print_ratios(times: dict[tuple[str, str], list[float]], parts: tuple[str, ...], unit: str = "ms",
                 scale: float = 1.0) -> None:
    """One line per part: the median torch and C++ times (x scale, in `unit`) and the median torch/C++ ratio of the
    alternated rounds with its range."""
    for what in parts:
        t, c = times[(what, "torch")], times[(what, "cpp")]
        ratios = [a / b for a, b in zip(t, c, strict=True)]
        print(f"{what:10s} torch {statistics.median(t) * scale:9.3f} {unit}  cpp {statistics.median(c) * scale:9.3f} "
              f"{unit}  torch/cpp {statistics.median(ratios):5.2f}x (rounds {min(ratios):.2f}-{max(ratios):.2f})")
