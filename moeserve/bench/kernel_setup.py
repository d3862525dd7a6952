"""Shared start of the one-layer kernel benchmarks (research/bench_mamba2_step.py, bench_mamba2_chunk.py,
bench_gated_delta.py): the --threads flag, the C++ kernels loaded (or exit naming why not), the numerics the layers
are built with (C++ ops, batch-invariant, this CPU's row block), the ModelSpec of a published config.json (the
scripts read the copies in tests/data/reference_configs), a Mamba-2 mixer with random weights and the recurrent
memory it reads, and the torch/C++ table they print."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from moeserve import kernels
from moeserve.models.layers.linear import Linear
from moeserve.models.mixers.mamba2 import Mamba2Mixer
from moeserve.models.mixers.mamba2_ssd import CppMamba2, Mamba2Kernels, TorchMamba2
from moeserve.models.numerics import Numerics, choose_row_block
from moeserve.models.registry import get_architecture
from moeserve.models.spec import ModelSpec


def add_threads_flag(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")


def prepare(args: argparse.Namespace, script: str, path: Path) -> ModelSpec:
    """Threads set, kernels loaded; the spec of the config.json at `path`."""
    if args.threads:
        torch.set_num_threads(args.threads)
    status = kernels.load()
    if not status.available:
        sys.exit(f"{script}: the C++ kernels are not available: {status.reason}")
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


class RecurrentSlots:
    """What Mamba2Mixer reads of the sequence memory: one group, `slots` conv histories and states."""

    def __init__(self, spec: ModelSpec, slots: int, dtype: torch.dtype) -> None:
        m = spec.mamba
        assert m is not None
        self.conv = torch.randn(slots, m.conv_kernel - 1, m.conv_dim).to(dtype)
        self.states = torch.randn(slots, m.num_heads, m.head_dim, m.state_size) * 0.1

    def recurrent(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.conv, self.states

    def group_of(self, layer: int) -> int:
        return 0


def mamba2_pair(spec: ModelSpec, dtype: torch.dtype) -> dict[str, Mamba2Mixer]:
    """Layer 0's Mamba-2 mixer on the torch kernels and on the C++ ones ("torch", "cpp"), the same weights."""
    return {name: build_mamba2(spec, dtype, kind(), torch.Generator().manual_seed(0))
            for name, kind in (("torch", TorchMamba2), ("cpp", CppMamba2))}


def per_call_ms(fn: Callable[[], object], calls: int) -> tuple[float, float]:
    """(wall, CPU) milliseconds per call after one warm-up call: on a shared machine the CPU time of the process
    (all its threads) moves less with the others' load than the wall time."""
    fn()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - wall) / calls * 1e3, (time.process_time() - cpu) / calls * 1e3


def build_mamba2(spec: ModelSpec, dtype: torch.dtype, mamba: Mamba2Kernels, gen: torch.Generator) -> Mamba2Mixer:
    """Layer 0's Mamba-2 mixer of `spec` with random weights drawn from `gen` (norms near 1, dt_bias near -3 as in
    the published checkpoints), on the `mamba` kernels and bench_numerics()."""
    m, h = spec.mamba, spec.hidden_size
    assert m is not None

    def rand(*shape: int, scale: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    numerics = bench_numerics()
    in_proj = Linear(rand(m.inner + m.conv_dim + m.num_heads, h), None, numerics)
    out_proj = Linear(rand(h, m.inner), None, numerics)
    conv = (rand(m.conv_dim, m.conv_kernel, scale=0.3), rand(m.conv_dim, scale=0.1))
    a_log = torch.log(torch.rand(m.num_heads, generator=gen) * 15 + 1).to(dtype)
    return Mamba2Mixer(m, 0, in_proj, out_proj, conv, a_log, (1 + rand(m.num_heads, scale=0.2)).to(dtype),
                       (-3 + rand(m.num_heads, scale=0.5)).to(dtype), (1 + rand(m.inner, scale=0.2)).to(dtype),
                       numerics, mamba)
