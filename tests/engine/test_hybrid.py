"""The hybrid placement (models/experts/hybrid.py) through the asynchronous fake GPU on CPU: hot experts in the
fake GPU's slots computed by the GPU side's canonical kernel (torch ops), missed experts either copied in or
computed by the CPU's C++ op from the host tier, as the placement chooser decides per layer call; every step's
logits equal to the all-resident run (C++ ops only) bit for bit, with the fast tier starting cold and warming up
mid-run, under placements forced to GPU-only, CPU-only, and mixed (hybrid with costs that alternate a decode token's
misses between the sides).

The engine is built as a user builds it with `placement=gpu|hybrid|cpu`, with two test-only hooks: three_tiers
gives its store the fake GPU + a host tier (so the store's fast tier is a device's, and the placement applies), and
the start-up probe reports hand-set costs instead of measuring a GPU (COSTS).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from moeserve.engine import plan as engine_plan
from moeserve.experts.placement import Costs
from moeserve.models import model as model_module
from moeserve.models.experts import hybrid as hybrid_module
from moeserve.models.experts.hybrid import HybridExperts
from tests.experts.test_three_tiers import FAST_UNITS, folder_of, logprob_tables, run, three_tiers

__all__ = ["folder_of", "three_tiers"]  # fixtures, used by name

FAST = 1e15  # compute and HBM so fast they never decide
COSTS = {
    "gpu": Costs(FAST, 1, FAST, FAST, FAST),  # hybrid, copies free: every miss copied (the GPU side computes all)
    "cpu": Costs(1, 1, FAST, FAST, FAST),
    # hybrid, PCIe as fast as host DRAM: a decode token's misses alternate CPU, copy, CPU, copy (ties go to the CPU)
    "mixed": Costs(1, 1, FAST, FAST, FAST),
}


def install_hybrid(monkeypatch: pytest.MonkeyPatch, placement: str) -> list[HybridExperts]:
    """From now on an engine's start-up probe reports COSTS[placement] as the measured placement costs; returns the
    list the hybrid kernels built (by models/experts/hybrid.place_experts, as for a user) are appended to."""
    made: list[HybridExperts] = []
    monkeypatch.setattr(engine_plan.StartupProbe, "placement_costs", lambda self, device: COSTS[placement])

    def place(*args, **kwargs):  # type: ignore[no-untyped-def]
        kernel, line = hybrid_module.place_experts(*args, **kwargs)
        if isinstance(kernel, HybridExperts):
            made.append(kernel)
        return kernel, line

    monkeypatch.setattr(model_module, "place_experts", place)
    return made


def check_hybrid_equals_resident(folder: Any, three_tiers: Callable, monkeypatch: pytest.MonkeyPatch,
                                 placement: str, label: str, **settings: Any) -> None:
    ref_logits, ref_outs, resident = run(folder, **settings)
    assert resident.resident
    three_tiers(resident.total_experts // 2)
    made = install_hybrid(monkeypatch, placement)
    logits, outs, store = run(folder, expert_cache_gb=FAST_UNITS * resident.unit_nbytes / 2**30,
                              placement="cpu" if placement == "cpu" else "hybrid", **settings)
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


@pytest.mark.parametrize("case", ["qwen2_moe", "mixtral", "olmoe", "glm4_moe", "qwen3_next", "gpt_oss", "int8",
                                  "nvfp4-ct", "mxfp4-gpt-oss"])
def test_hybrid_mixed_placement_every_canonical_family_and_format(folder_of, three_tiers, monkeypatch,
                                                                   case: str) -> None:
    settings = {"quantization": "int8"} if case == "int8" else {}
    check_hybrid_equals_resident(folder_of(case), three_tiers, monkeypatch, "mixed", case, **settings)



def test_the_placement_line_and_refusals(folder_of, three_tiers, monkeypatch) -> None:
    from moeserve.engine.llm import LLM
    from moeserve.errors import ConfigError

    folder = folder_of("qwen3_moe")
    cpu = LLM(str(folder), skip_tokenizer_init=True, threads=1)
    try:
        assert dict(cpu.engine.model.choices)["placement"].startswith("every expert resident")
    finally:
        cpu.engine.close()
    with pytest.raises(ConfigError, match="placement=cpu needs a CUDA device"):
        LLM(str(folder), skip_tokenizer_init=True, threads=1, expert_cache_gb=1e-7, placement="cpu")
    three_tiers(4)
    install_hybrid(monkeypatch, "mixed")
    with pytest.raises(ConfigError, match="placement=hybrid is not possible here: units without a fused C"):
        LLM(str(folder_of("fp8-block")), skip_tokenizer_init=True, threads=1, expert_cache_gb=1e-7,
            placement="hybrid")


def test_metrics_show_where_experts_ran_and_the_costs() -> None:
    from moeserve.experts.placement import PlacementStats
    from moeserve.server.metrics import _placement_lines

    class Engine:
        def placement_stats(self):  # type: ignore[no-untyped-def]
            return PlacementStats(gpu_hits=7, copied=2, cpu=5, cpu_seconds=0.25, calls=3), COSTS["mixed"]

    text = "\n".join(_placement_lines(Engine(), {"model_name": "m"}))
    assert 'moeserve:expert_placements_total{model_name="m",where="cpu"} 5' in text
    assert 'moeserve:expert_placements_total{model_name="m",where="gpu_hit"} 7' in text
    assert 'moeserve:expert_placement_cost{kind="h2d_bytes_per_s",model_name="m"} 1' in text
    assert "moeserve:expert_cpu_side_seconds_total" in text
    assert _placement_lines(object(), {}) == []


@pytest.mark.parametrize("case", ["gpt_oss", "mxfp4-gpt-oss", "gguf-gpt-oss", "nvfp4-ct", "mxfp4-ct",
                                  "nvfp4-modelopt", "int8"])
def test_canonical_kernel_equals_the_models_cpu_kernel(folder_of, case: str) -> None:
    """The GPU side's kernel on a model's own units (as loaded, every format) against the kernel the CPU engine
    chose for them, bit for bit, on random token rows: the C++ ops of every unit kind the hybrid takes."""
    from moeserve.engine.llm import LLM
    from moeserve.models.experts.canonical import CanonicalExperts
    from moeserve.models.experts.kernels import RoutedTokens

    llm = LLM(str(folder_of(case)), skip_tokenizer_init=True, threads=1,
              quantization="int8" if case.startswith("int8") else "none")
    try:
        block = llm.engine.model.moe_blocks[0]
        units = llm.engine.model.store.resident_units(block.layer)
        kernel = block.experts
        assert kernel.name.startswith("cpp"), kernel.describe()
        ours = CanonicalExperts(kernel.math, kernel.math.fused_units())
        gen = torch.Generator().manual_seed(1)
        n, e, k = 24, len(units), block.spec.top_k
        x = torch.randn(n, llm.engine.model.spec.hidden_size, generator=gen).bfloat16()
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
        order = torch.argsort(ids.reshape(-1), stable=True)
        weights = torch.rand(n * k, generator=gen)[order]
        routed = RoutedTokens.from_counts(x, ids, order // k, weights, torch.bincount(ids.reshape(-1), minlength=e)
                                          .tolist())
        outs = []
        for kern in (kernel, ours):
            out = torch.zeros_like(x)
            kern.run(out, routed, [[(i, units[i]) for i in routed.experts]])
            outs.append(out)
        assert outs[0].isfinite().all() and outs[0].abs().sum() > 0
        assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16)), ours.describe()
    finally:
        llm.engine.close()


def test_the_cpu_side_runs_while_the_gpu_side_computes(folder_of, three_tiers, monkeypatch) -> None:
    """Overlap, shown without timing: in every call with work on both sides, the CPU side (worker thread) waits until
    the GPU side of the same call has started. Run one after the other on one thread, it would wait in vain."""
    import threading

    from moeserve.models.experts.canonical import CanonicalExperts

    gpu_started = threading.Event()
    waited: list[bool] = []
    compute, cpu_side, contributions = HybridExperts.compute, HybridExperts._cpu_side, CanonicalExperts.contributions

    def new_call(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        gpu_started.clear()
        return compute(self, *args, **kwargs)

    def cpu_waits_for_gpu(self, store, layer, experts, spans, *rest):  # type: ignore[no-untyped-def]
        if len(spans) > len(experts):  # the GPU side has experts of this call too
            waited.append(gpu_started.wait(30))
        return cpu_side(self, store, layer, experts, spans, *rest)

    def gpu_starts(self, *args):  # type: ignore[no-untyped-def]
        gpu_started.set()
        return contributions(self, *args)

    monkeypatch.setattr(HybridExperts, "compute", new_call)
    monkeypatch.setattr(HybridExperts, "_cpu_side", cpu_waits_for_gpu)
    monkeypatch.setattr(CanonicalExperts, "contributions", gpu_starts)
    check_hybrid_equals_resident(folder_of("qwen3_moe"), three_tiers, monkeypatch, "mixed", "overlap")
    assert waited and all(waited), f"{waited.count(False)} of {len(waited)} calls: the CPU side ran alone"
