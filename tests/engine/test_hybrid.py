"""The hybrid placement (models/experts/hybrid.py) through the asynchronous fake GPU on CPU: hot experts in the
fake GPU's slots computed by the GPU side's canonical kernel (torch ops), missed experts either copied in or
computed by the CPU's C++ op from the host tier, as the placement chooser decides per layer call; every step's
logits equal to the all-resident run (C++ ops only) bit for bit, with the fast tier starting cold and warming up
mid-run, under placements forced to GPU-only, CPU-only, and mixed (auto with costs that alternate a decode token's
misses between the sides).

The test hook is test-only: it wraps `choose_expert_kernel` (as tests/experts/test_three_tiers_batched.py does) so
the offloaded engine runs `HybridExperts` on CPU, and three_tiers gives its store the fake GPU + a host tier.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from moeserve.experts.placement import Costs, PlacementChooser
from moeserve.models import model as model_module
from moeserve.models.experts.canonical import CanonicalExperts
from moeserve.models.experts.hybrid import HybridExperts
from moeserve.models.experts.kernels import choose_expert_kernel
from tests.experts.test_three_tiers import FAST_UNITS, folder_of, logprob_tables, run, three_tiers

__all__ = ["folder_of", "three_tiers"]  # fixtures, used by name

FAST = 1e15  # compute and HBM so fast they never decide
COSTS = {
    "gpu": Costs(1, 1, FAST, FAST, FAST),
    "cpu": Costs(1, 1, FAST, FAST, FAST),
    # PCIe as fast as host DRAM: a decode token's misses alternate CPU, copy, CPU, copy (ties go to the CPU)
    "mixed": Costs(1, 1, FAST, FAST, FAST),
}


def install_hybrid(monkeypatch: pytest.MonkeyPatch, placement: str) -> list[HybridExperts]:
    made: list[HybridExperts] = []

    def choose(math, numerics, dtype, device=torch.device("cpu"), batched=None, top_k=8):  # type: ignore[no-untyped-def]
        cpu = choose_expert_kernel(math, numerics, dtype, device, top_k=top_k)
        units = math.fused_units()
        assert CanonicalExperts.supports(units, dtype), f"no canonical form for {type(math).__name__}"
        mode = "auto" if placement == "mixed" else placement
        kernel = HybridExperts(CanonicalExperts(math, units), cpu, PlacementChooser(mode, COSTS[placement]), 1)
        made.append(kernel)
        return kernel

    monkeypatch.setattr(model_module, "choose_expert_kernel", choose)
    return made


def check_hybrid_equals_resident(folder: Any, three_tiers: Callable, monkeypatch: pytest.MonkeyPatch,
                                 placement: str, label: str, **settings: Any) -> None:
    ref_logits, ref_outs, resident = run(folder, **settings)
    assert resident.resident
    three_tiers(resident.total_experts // 2)
    made = install_hybrid(monkeypatch, placement)
    logits, outs, store = run(folder, expert_cache_gb=FAST_UNITS * resident.unit_nbytes / 2**30, **settings)
    assert not store.resident and store.capacity == FAST_UNITS and len(made) == 1
    stats = made[0].snapshot()
    if placement != "gpu":  # (gpu-only: 3 slots for every layer's experts, each evicted before its layer returns)
        assert stats.gpu_hits > 0, f"{label}: the fast tier never warmed"
        assert stats.cpu > 0, f"{label}: no expert computed on the CPU"
    else:
        assert stats.cpu == 0
    if placement != "cpu":
        assert stats.copied > 0, f"{label}: no expert copied to the GPU"
    else:
        assert stats.copied <= FAST_UNITS  # only while free slots remained: the cache warming
    for step, (a, b) in enumerate(zip(logits, ref_logits, strict=True)):
        assert torch.equal(a, b), f"{label}: logits differ at step {step}"
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref_outs]
    assert logprob_tables(outs) == logprob_tables(ref_outs)


# ids that are not the word "gpu": tests/conftest.py skips tests with that keyword on a machine without CUDA
@pytest.mark.parametrize("placement", ["gpu", "cpu", "mixed"], ids=["gpu-only", "cpu-only", "mixed"])
def test_hybrid_placements_equal_resident(folder_of, three_tiers, monkeypatch, placement: str) -> None:
    check_hybrid_equals_resident(folder_of("qwen3_moe"), three_tiers, monkeypatch, placement, placement)


@pytest.mark.parametrize("case", ["qwen2_moe", "mixtral", "olmoe", "glm4_moe", "int8"])
def test_hybrid_mixed_placement_every_canonical_family_and_format(folder_of, three_tiers, monkeypatch,
                                                                   case: str) -> None:
    settings = {"quantization": "int8"} if case == "int8" else {}
    check_hybrid_equals_resident(folder_of(case), three_tiers, monkeypatch, "mixed", case, **settings)

