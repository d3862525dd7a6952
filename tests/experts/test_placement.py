"""The placement chooser (moeserve/experts/placement.py) against costs computed by hand. No torch."""

from __future__ import annotations

import pytest

from moeserve.experts.placement import (
    RECHECK_CALLS,
    Costs,
    CostTracker,
    ExpertWork,
    PlacementChooser,
    check_placement,
    resolve_placement,
    typical_split,
)

# Round numbers so every figure below is exact: a unit of 100 bytes, 10 flop per token.
COSTS = Costs(h2d_bytes_per_s=10, host_read_bytes_per_s=20, hbm_bytes_per_s=100, cpu_flops=1000, gpu_flops=10000)
UNIT, FLOPS = 100, 10


def work(expert: int, tokens: int = 1) -> ExpertWork:
    return ExpertWork(expert, tokens, UNIT, FLOPS)


def test_decode_misses_split_where_the_call_finishes_first() -> None:
    # per miss of 1 token: CPU 100/20 = 5 s; copy 100/10 = 10 s; GPU compute 100/100 = 1 s.
    # e0: GPU would end at max(1, 10) = 10, CPU at 5 -> CPU.  e1: GPU 10, CPU 10: a tie -> CPU.
    # e2: GPU 10, CPU 15 -> copied.  e3: GPU max(2, 20) = 20, CPU 15 -> CPU.
    split = PlacementChooser("hybrid", COSTS).choose([], [work(3), work(0), work(2), work(1)])
    assert split.cpu == (0, 1, 3) and split.copy == (2,)
    assert (split.cpu_s, split.gpu_s, split.seconds) == (15, 10, 15)


def test_hits_keep_the_gpu_busy_and_push_misses_to_the_cpu() -> None:
    # 12 hits: 12 s of GPU compute. A miss copied ends the GPU at max(13, 10) = 13; on the CPU at 5.
    hits = [work(e) for e in range(10, 22)]
    split = PlacementChooser("hybrid", COSTS).choose(hits, [work(0), work(1)])
    assert split.cpu == (0, 1) and split.copy == () and split.gpu_s == 12 and split.cpu_s == 10


def test_prefill_sized_experts_go_to_the_gpu_first() -> None:
    costs = Costs(10, 20, 100, cpu_flops=500, gpu_flops=10000)
    # 1000 tokens: CPU max(5, 10000 / 500) = 20 s; GPU compute max(1, 1) = 1 s; copy 10 s.
    # the 1000-token experts first (ids ascending among equals): e4 copied (10 < 20); e7: GPU max(2, 20) = 20, CPU
    # max(10, 20) = 20: a tie -> CPU.  e1 (1 token, CPU 5 s): GPU max(1 + 1 + 1, 10 + 10) = 20 vs CPU
    # max(10, 20 + 5) = 25 -> copied.
    split = PlacementChooser("hybrid", costs).choose([], [work(1), work(7, 1000), work(4, 1000)])
    assert split.copy == (1, 4) and split.cpu == (7,) and split.cpu_s == 20 and split.gpu_s == 20


def test_forced_placements() -> None:
    misses = [work(e) for e in range(4)]
    assert PlacementChooser("gpu", COSTS).choose([], misses).copy == (0, 1, 2, 3)
    cpu = PlacementChooser("cpu", COSTS)
    assert cpu.choose([], misses).cpu == (0, 1, 2, 3)
    warming = cpu.choose([], misses, free_slots=2)  # free GPU slots are filled first: the cache warms
    assert warming.copy == (0, 1) and warming.cpu == (2, 3)


def test_unknown_placement_says_did_you_mean() -> None:
    assert check_placement("cpu") == "cpu"
    with pytest.raises(ValueError, match="did you mean 'auto'"):
        PlacementChooser("atuo", COSTS)
    with pytest.raises(ValueError, match="did you mean 'hybrid'"):
        check_placement("hybird")
    with pytest.raises(ValueError, match="resolve placement=auto first"):
        PlacementChooser("auto", COSTS)
    with pytest.raises(ValueError, match="valid: auto, gpu, hybrid, cpu"):
        check_placement("zzzzz")
    with pytest.raises(ValueError, match="h2d_bytes_per_s must be > 0"):
        Costs(0, 1, 1, 1, 1)


def test_tracker_rechecks_costs_and_logs_a_changed_split() -> None:
    chooser = PlacementChooser("hybrid", COSTS)
    tracker = CostTracker(chooser, top_k=4, unit_bytes=UNIT, flops_per_token=FLOPS)
    assert typical_split(chooser, 4, UNIT, FLOPS).endswith("3 on the CPU, 1 copied")
    tracker.observe_cpu(100, 100.0)  # the CPU side reads at 1 B/s on real calls: far slower than probed
    lines = [tracker.recheck() for _ in range(RECHECK_CALLS)]
    assert lines[:-1] == [None] * (RECHECK_CALLS - 1)
    assert lines[-1] is not None and "0 on the CPU, 4 copied" in lines[-1] and "(was: " in lines[-1]
    assert chooser.costs.host_read_bytes_per_s == 1 and "re-measured" in chooser.costs.source
    assert all(tracker.recheck() is None for _ in range(RECHECK_CALLS))  # unchanged rates: nothing to say


def test_resolving_the_setting() -> None:
    assert resolve_placement("auto", "cpu", False, None)[0] == "none"
    with pytest.raises(ValueError, match="placement=cpu needs a CUDA device"):
        resolve_placement("cpu", "cpu", False, None)
    mode, why = resolve_placement("auto", "cuda", True, None)
    assert mode == "gpu" and "no GPU speed figure yet" in why
    assert resolve_placement("hybrid", "cuda", True, None)[0] == "hybrid"
    assert resolve_placement("cpu", "cuda", True, None)[0] == "cpu"
    with pytest.raises(ValueError, match="no host tier"):
        resolve_placement("hybrid", "cuda", False, None)
    with pytest.raises(ValueError, match="not possible here: fp8 units"):
        resolve_placement("cpu", "cuda", True, "fp8 units")
    assert resolve_placement("auto", "cuda", True, "fp8 units") == ("gpu", "auto: every miss copied to a GPU slot "
                                                                           "(fp8 units)")
