"""Where a MoE layer call's experts are computed on a GPU machine with host RAM: the placement policy (pure Python).

    costs = Costs(h2d_bytes_per_s=..., host_read_bytes_per_s=..., hbm_bytes_per_s=..., cpu_flops=..., gpu_flops=...)
    chooser = PlacementChooser("hybrid", costs)
    split = chooser.choose(hits, misses)   # hits: experts already in a GPU slot; misses: the others
    split.cpu                              # misses computed by the CPU from host RAM, where they sit
    split.copy                             # misses copied over PCIe to a GPU slot and computed there

Each expert of a call is an `ExpertWork` (its id, the tokens routed to it, its unit's bytes, its flops per token).
The GPU computes the hits and the copied misses; the CPU computes its share at the same time (the hybrid kernel,
models/experts/hybrid.py, overlaps them), so a call takes the longer of the two:

    gpu_s(copy) = max(sum of gpu_compute_s over hits + copy,  sum of copy_s over copy)   (copies overlap compute)
    cpu_s(cpu)  = sum of cpu_s over cpu
    cpu_s(e) = max(unit bytes / host_read_bytes_per_s, tokens * flops / cpu_flops)       (a roofline)
    gpu_compute_s(e) = max(unit bytes / hbm_bytes_per_s, tokens * flops / gpu_flops)
    copy_s(e) = unit bytes / h2d_bytes_per_s

`hybrid` places the misses one at a time, most tokens first (ties: lower id first), each on the side whose finish
time grows least (ties: the CPU, which moves no bytes over PCIe). `gpu` copies every miss (the store's behaviour
without a hybrid); `cpu` computes every miss on the CPU once the GPU's slots are full (`free_slots`: while slots
are free a miss fills one, so the cache warms). The choice never changes a bit of the output: both sides compute an
expert in the same canonical order (docs/design/gpu.md, "GPU and hybrid").

The costs come from start-up probes (memory/probes.py, `host_to_device_bandwidth`, `memory_bandwidth`, and the
expert compute rates the hybrid kernel times) and are re-checked as the run goes: `CostTracker` folds the rates
measured on real calls into the costs every `RECHECK_CALLS` calls and says when the choice for a typical call
changed, with the reason. No torch here: tests/experts/test_placement.py checks it against hand-computed costs.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass, replace

PLACEMENTS = ("auto", "gpu", "hybrid", "cpu")  # the `placement` setting; the chooser takes the last three
RECHECK_CALLS = 256  # layer calls between two re-checks of the costs
SMOOTHING = 0.25  # weight of a new measurement in the running rate


def check_placement(value: str) -> str:
    """`value` when it names a placement, else ValueError with a "did you mean"."""
    if value in PLACEMENTS:
        return value
    close = difflib.get_close_matches(value, PLACEMENTS, n=1, cutoff=0.5)
    hint = f" (did you mean '{close[0]}'?)" if close else f" (valid: {', '.join(PLACEMENTS)})"
    raise ValueError(f"unknown placement {value!r}{hint}")


@dataclass(frozen=True)
class Costs:
    """What moving and computing an expert costs on this machine, in bytes/s and flop/s (all > 0)."""

    h2d_bytes_per_s: float  # host -> GPU copies (PCIe), pinned where the host tier is
    host_read_bytes_per_s: float  # host DRAM read by the CPU expert op
    hbm_bytes_per_s: float  # GPU memory read by the GPU expert kernel
    cpu_flops: float  # CPU expert op, flop/s on units already in cache
    gpu_flops: float  # GPU expert kernel, flop/s
    source: str = "measured at start-up"

    def __post_init__(self) -> None:
        for name in ("h2d_bytes_per_s", "host_read_bytes_per_s", "hbm_bytes_per_s", "cpu_flops", "gpu_flops"):
            if not getattr(self, name) > 0:
                raise ValueError(f"placement costs: {name} must be > 0, got {getattr(self, name)}")

    def describe(self) -> str:
        return (f"PCIe H2D {self.h2d_bytes_per_s / 1e9:.3g} GB/s, host DRAM read {self.host_read_bytes_per_s / 1e9:.3g}"
                f" GB/s, HBM {self.hbm_bytes_per_s / 1e9:.3g} GB/s, CPU experts {self.cpu_flops / 1e9:.3g} GFLOP/s, "
                f"GPU experts {self.gpu_flops / 1e9:.3g} GFLOP/s ({self.source})")


@dataclass(frozen=True)
class ExpertWork:
    """One expert of a layer call."""

    expert: int
    tokens: int  # tokens routed to it in this call
    unit_bytes: int  # its unit as held (what a copy or a CPU pass reads)
    flops_per_token: int  # 2 * (multiply-adds of its projections)


def cpu_seconds(w: ExpertWork, c: Costs) -> float:
    return max(w.unit_bytes / c.host_read_bytes_per_s, w.tokens * w.flops_per_token / c.cpu_flops)


def gpu_compute_seconds(w: ExpertWork, c: Costs) -> float:
    return max(w.unit_bytes / c.hbm_bytes_per_s, w.tokens * w.flops_per_token / c.gpu_flops)


def copy_seconds(w: ExpertWork, c: Costs) -> float:
    return w.unit_bytes / c.h2d_bytes_per_s


@dataclass(frozen=True)
class Split:
    """A call's misses split between the CPU and copies to the GPU (ascending ids), and the modelled seconds."""

    cpu: tuple[int, ...]
    copy: tuple[int, ...]
    cpu_s: float
    gpu_s: float

    @property
    def seconds(self) -> float:
        return max(self.cpu_s, self.gpu_s)


class PlacementChooser:
    """The per-call choice (module docstring). Pure: the same inputs give the same split."""

    def __init__(self, mode: str, costs: Costs) -> None:
        if check_placement(mode) == "auto":
            raise ValueError("PlacementChooser: resolve placement=auto first (resolve_placement)")
        self.mode, self.costs = mode, costs

    def choose(self, hits: Sequence[ExpertWork], misses: Sequence[ExpertWork], free_slots: int = 0) -> Split:
        """The split of `misses` for a call whose `hits` the GPU holds. `free_slots`: GPU slots free now (under
        `cpu`, the first misses fill them)."""
        c = self.costs
        gpu_compute = sum(gpu_compute_seconds(w, c) for w in hits)
        copy_s = cpu_s = 0.0
        cpu: list[int] = []
        copy: list[int] = []
        for w in sorted(misses, key=lambda w: (-w.tokens, w.expert)):
            to_gpu = self._to_gpu(w, gpu_compute, copy_s, cpu_s, free_slots - len(copy))
            if to_gpu:
                copy.append(w.expert)
                gpu_compute += gpu_compute_seconds(w, c)
                copy_s += copy_seconds(w, c)
            else:
                cpu.append(w.expert)
                cpu_s += cpu_seconds(w, c)
        return Split(tuple(sorted(cpu)), tuple(sorted(copy)), cpu_s, max(gpu_compute, copy_s))

    def _to_gpu(self, w: ExpertWork, gpu_compute: float, copy_s: float, cpu_s: float, free_slots: int) -> bool:
        if self.mode == "gpu":
            return True
        if self.mode == "cpu":
            return free_slots > 0
        c = self.costs
        gpu_end = max(gpu_compute + gpu_compute_seconds(w, c), copy_s + copy_seconds(w, c))
        as_gpu = max(gpu_end, cpu_s)
        as_cpu = max(max(gpu_compute, copy_s), cpu_s + cpu_seconds(w, c))
        return as_gpu < as_cpu

    def describe(self) -> str:
        rule = {"hybrid": "each miss where the call finishes sooner (CPU from RAM vs copy over PCIe)",
                "gpu": "every miss copied to a GPU slot", "cpu": "every miss computed by the CPU from RAM once the "
                "GPU slots are full"}[self.mode]
        return f"{self.mode}: {rule}; costs: {self.costs.describe()}"


def resolve_placement(want: str, device_type: str, host_tier: bool, why_not_canonical: str | None) -> tuple[str, str]:
    """(placement, reason) for the `placement` setting `want`: "none" on a machine without a GPU, else gpu, hybrid
    or cpu. ValueError (one line) when an explicit hybrid or cpu cannot apply: no CUDA device, no host tier (unified
    memory: one pool), or units without a canonical form on both devices (`why_not_canonical`)."""
    check_placement(want)
    if device_type == "cpu":
        if want != "auto":
            raise ValueError(f"placement={want} needs a CUDA device (this engine computes on the CPU)")
        return "none", "CPU: every expert computed where it is held"
    blocker = (None if host_tier else "no host tier (unified memory: one pool, the GPU computes every expert)") \
        or why_not_canonical
    if want in ("hybrid", "cpu") and blocker is not None:
        raise ValueError(f"placement={want} is not possible here: {blocker} (use auto or gpu)")
    if want == "gpu":
        return "gpu", "asked for: every miss copied to a GPU slot"
    if want != "auto":
        return want, f"asked for: {'per layer call, from measured costs' if want == 'hybrid' else 'misses on the CPU'}"
    return "gpu", (f"auto: every miss copied to a GPU slot ({blocker})" if blocker is not None else
                   "auto: every miss copied to a GPU slot (the hybrid's GPU kernel, the canonical order in torch "
                   "ops, has no GPU speed figure yet; placement=hybrid or cpu turns it on)")


def typical_split(chooser: PlacementChooser, top_k: int, unit_bytes: int, flops_per_token: int) -> str:
    """One line: how a decode token's call (top_k experts, all missed) splits under `chooser`."""
    misses = [ExpertWork(e, 1, unit_bytes, flops_per_token) for e in range(top_k)]
    split = chooser.choose([], misses)
    return f"a decode token's {top_k} missed experts: {len(split.cpu)} on the CPU, {len(split.copy)} copied"


@dataclass
class PlacementStats:
    """Expert computations by where they ran, since start-up (exported by /metrics)."""

    gpu_hits: int = 0  # experts already in a GPU slot
    copied: int = 0  # misses copied to a GPU slot and computed there
    cpu: int = 0  # misses computed by the CPU from host RAM
    cpu_seconds: float = 0.0  # wall time of the CPU side
    calls: int = 0


@dataclass
class CostTracker:
    """The costs as the run goes: rates measured on real calls (`observe_*`) folded in every `RECHECK_CALLS`
    calls; `recheck` returns a log line when the typical decode call's split changed (None otherwise)."""

    chooser: PlacementChooser
    top_k: int
    unit_bytes: int
    flops_per_token: int
    calls: int = 0
    _cpu_rate: float | None = None  # bytes/s the CPU side achieved on its experts (roofline: bytes bound at decode)
    _h2d_rate: float | None = None

    def observe_cpu(self, nbytes: int, seconds: float) -> None:
        self._cpu_rate = _smooth(self._cpu_rate, nbytes / seconds) if seconds > 0 else self._cpu_rate

    def observe_copy(self, nbytes: int, seconds: float) -> None:
        self._h2d_rate = _smooth(self._h2d_rate, nbytes / seconds) if seconds > 0 else self._h2d_rate

    def recheck(self) -> str | None:
        """Counts one call; every RECHECK_CALLS calls, the measured rates replace the costs' (logged when the
        typical split changes)."""
        self.calls += 1
        if self.calls % RECHECK_CALLS or (self._cpu_rate is None and self._h2d_rate is None):
            return None
        before = typical_split(self.chooser, self.top_k, self.unit_bytes, self.flops_per_token)
        c = self.chooser.costs
        self.chooser.costs = replace(c, host_read_bytes_per_s=self._cpu_rate or c.host_read_bytes_per_s,
                                     h2d_bytes_per_s=self._h2d_rate or c.h2d_bytes_per_s,
                                     source=f"re-measured on {self.calls} calls")
        after = typical_split(self.chooser, self.top_k, self.unit_bytes, self.flops_per_token)
        if after == before:
            return None
        return f"placement re-checked: {after} (was: {before}); {self.chooser.costs.describe()}"


def _smooth(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
