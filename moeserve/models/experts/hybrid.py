"""The hybrid expert kernel of a GPU machine with host RAM: hot experts on the GPU, cold ones computed where they sit.

    split = chooser.choose(hits, misses)                  # experts/placement.py: CPU from RAM, or copy to a GPU slot
    cpu   = worker.submit(C++ op on split.cpu's host units)   # overlapped with ...
    gpu   = canonical kernel on store.experts(hits + split.copy)
    out  += every pair's contribution, in ascending expert order, one rounding per add

Both sides give each (token, expert) pair its contribution round_bf16(round_bf16(down output) * weight): the GPU
side with `CanonicalExperts` (models/experts/canonical.py), the CPU side with the C++ op run on one row per pair
into zeros (0 + c = c), so the same bits as the single-process C++ op, which adds the same contributions in the
same order into `out`. Since both compute an expert in the canonical order, which device computed it never
changes a bit: a cache that warms mid-run, or costs that move the split, change the speed only.

Missed experts the chooser gives the CPU are read by the store's loader into (or found in) the host tier and held
there while the CPU computes (`Loader.on_host`); they never take a GPU slot. The GPU side fetches its experts
through `store.experts` as every other kernel does (hits, and misses copied in). Counters for /metrics: `stats`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack

import torch

from moeserve import kernels
from moeserve.errors import ConfigError
from moeserve.experts.placement import (
    Costs,
    CostTracker,
    ExpertWork,
    PlacementChooser,
    PlacementStats,
    Split,
    resolve_placement,
    typical_split,
)
from moeserve.experts.store import ExpertStore
from moeserve.models.experts.canonical import CanonicalExperts
from moeserve.models.experts.kernels import (
    Chunk,
    ExpertKernel,
    RoutedTokens,
    add_in_expert_order,
    choose_expert_kernel,
)
from moeserve.models.experts.unit_math import UnitMath
from moeserve.models.numerics import Numerics
from moeserve.models.spec import ModelSpec

log = logging.getLogger("moeserve")


class HybridExperts(ExpertKernel):
    """Splits each layer call between the GPU (`gpu`: the canonical kernel on the store's slots) and the CPU (`cpu`:
    the C++ op on host units), as `chooser` decides per call (module docstring)."""

    name = "hybrid"

    def __init__(self, gpu: CanonicalExperts, cpu: ExpertKernel, chooser: PlacementChooser, flops_per_token: int,
                 tracker: CostTracker | None = None) -> None:
        super().__init__(gpu.math)
        self.gpu, self.cpu, self.chooser, self.tracker = gpu, cpu, chooser, tracker
        self.flops_per_token = flops_per_token  # one expert, one token: 2 x its multiply-adds
        self.stats = PlacementStats()
        self._lock = threading.Lock()  # guards stats against /metrics readers
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="moeserve-cpu-experts")

    def run(self, out: torch.Tensor, routed: RoutedTokens, chunks: Iterable[Chunk]) -> None:
        """Units already lent (no store to split against): all on the GPU side."""
        self.gpu.run(out, routed, chunks)

    def compute(self, out: torch.Tensor, routed: RoutedTokens, store: ExpertStore, layer: int,
                prefetch: tuple[int, Sequence[int]] | None = None) -> None:
        split = self._split(routed, store, layer)
        y = torch.zeros(len(routed.token_of), routed.x.shape[1], dtype=torch.bfloat16, device=routed.x.device)
        pending: Future[tuple[torch.Tensor, torch.Tensor, float]] | None = None
        if split.cpu:
            pairs = torch.cat([torch.arange(*routed.spans[e]) for e in split.cpu])  # their pairs, in pair order
            x_rows = routed.x[routed.token_of[pairs.to(routed.x.device)]].cpu()  # [pairs, H] on the host
            weights = routed.weight_of[pairs.to(routed.weight_of.device)].cpu()
            pending = self._worker.submit(self._cpu_side, store, layer, split.cpu, routed.spans, pairs, x_rows,
                                          weights)
        on_gpu = [e for e in routed.experts if e not in set(split.cpu)]
        if on_gpu:  # enqueued on the GPU while the CPU computes its share
            self.gpu.contributions(y, routed, store.experts(layer, on_gpu, prefetch=prefetch))
        if pending is not None:
            pairs, y_cpu, seconds = pending.result()
            y[pairs.to(y.device)] = y_cpu.to(y.device)
            self._observe(len(split.cpu) * store.unit_nbytes, seconds)
        add_in_expert_order(out, routed.token_of, y)

    def _split(self, routed: RoutedTokens, store: ExpertStore, layer: int) -> Split:
        if store.resident:
            return Split((), (), 0.0, 0.0)
        row = store.slot_table[store.layers.index(layer)]  # a hint: the store re-checks every hit it lends
        flops = self.flops_per_token
        hits: list[ExpertWork] = []
        misses: list[ExpertWork] = []
        for e, (lo, hi) in routed.spans.items():
            (hits if int(row[e]) >= 0 else misses).append(ExpertWork(e, hi - lo, store.unit_nbytes, flops))
        free = store.capacity - int((store.slot_table >= 0).sum())
        split = self.chooser.choose(hits, misses, free_slots=free)
        with self._lock:
            self.stats.calls += 1
            self.stats.gpu_hits += len(hits)
            self.stats.copied += len(split.copy)
            self.stats.cpu += len(split.cpu)
        return split

    def _cpu_side(self, store: ExpertStore, layer: int, experts: tuple[int, ...], spans: dict[int, tuple[int, int]],
                  pairs: torch.Tensor, x_rows: torch.Tensor,
                  weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(pairs, their contributions [pairs, H] bf16, seconds): the C++ op over the experts' host units, one row
        per pair into zeros."""
        t0 = time.perf_counter()
        local: dict[int, tuple[int, int]] = {}
        start = 0
        for e in experts:
            n = spans[e][1] - spans[e][0]
            local[e] = (start, start + n)
            start += n
        sub = RoutedTokens(x_rows.contiguous(), torch.empty(0), torch.arange(start), weights, local)
        y = torch.zeros(start, x_rows.shape[1], dtype=torch.bfloat16)
        with ExitStack() as held:
            chunk = [(e, store.layout.views(held.enter_context(store.loader.on_host((layer, e))))) for e in experts]
            self.cpu.run(y, sub, [chunk])
        return pairs, y, time.perf_counter() - t0

    def _observe(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.stats.cpu_seconds += seconds
        if self.tracker is not None:
            self.tracker.observe_cpu(nbytes, seconds)
            line = self.tracker.recheck()
            if line is not None:
                log.info(line)

    def snapshot(self) -> PlacementStats:
        with self._lock:
            s = self.stats
            return PlacementStats(s.gpu_hits, s.copied, s.cpu, s.cpu_seconds, s.calls)

    def close(self) -> None:
        self._worker.shutdown(wait=True)

    def placement_stats(self) -> tuple[PlacementStats, Costs]:
        return self.snapshot(), self.chooser.costs

    def describe(self) -> str:
        return (f"hybrid (GPU: {self.gpu.describe()}; CPU, overlapped: {self.cpu.describe()}; placement "
                f"{self.chooser.describe()})")


def place_experts(kernel: ExpertKernel, math: UnitMath, dtype: torch.dtype, store: ExpertStore, want: str,
                  costs: Costs | None, spec: ModelSpec) -> tuple[ExpertKernel, str]:
    """(the kernel the MoE layers run, the start-up log's placement line) for the `placement` setting `want`:
    `kernel` as chosen, or a HybridExperts whose CPU side is the C++ op on the same units (experts/placement.py
    resolve_placement says when; an explicit placement that cannot apply raises ConfigError)."""
    units = math.fused_units()
    why_not = CanonicalExperts.why_not(units, dtype)
    if store.resident:
        if want in ("hybrid", "cpu") and why_not is None and units is not None and store.device.type != "cpu":
            # the same kernel as the GPU side of an offloaded run: resident == offloaded under this placement
            return CanonicalExperts(math, units), "every expert resident on the GPU: all on the canonical kernel"
        return kernel, "every expert resident in the fast tier: nothing to place"
    device = "cuda" if store.copier is not None else store.device.type  # a device fast tier (tests: a fake one)
    if why_not is None and want in ("hybrid", "cpu") and store.device.type != "cpu":
        status = kernels.load("native")  # the CPU side's ops, in a process that computes on a GPU
        why_not = None if status.available else f"the C++ expert ops are not available ({status.reason})"
    try:
        mode, reason = resolve_placement(want, device, store.loader.host is not None, why_not)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if mode not in ("hybrid", "cpu"):
        return kernel, reason
    if costs is None:
        raise ConfigError(f"placement={want}: no placement costs were measured (a CUDA engine measures them)")
    assert units is not None  # resolve_placement checked them
    flops = 6 * spec.hidden_size * spec.moe.intermediate_size  # gate_up [2I, H] and down [H, I]: 3HI multiply-adds
    cpu = choose_expert_kernel(math, Numerics(cpp=True, batch_invariant=True), dtype)  # canonical at any batch
    chooser = PlacementChooser(mode, costs)
    tracker = CostTracker(chooser, spec.moe.top_k, store.unit_nbytes, flops)
    hybrid = HybridExperts(CanonicalExperts(math, units), cpu, chooser, flops, tracker)
    return hybrid, f"{reason}; {typical_split(chooser, spec.moe.top_k, store.unit_nbytes, flops)}"
