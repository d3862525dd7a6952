"""The noaux_tc routing op (csrc/routing_noaux.cpp, moe.CppSigmoidGroups) against the torch ops (moe.SigmoidGroups):
the same expert ids in the same order, the same fp32 weights and the same grouping, bit for bit, for the routers of
the published DeepSeek-V3, Kimi-K2, GLM-4.5-Air and Nemotron-3-Nano configs (read by the engine's own spec
readers), batch 1..64, bf16 and fp32 logits, in fixed row blocks (batch_invariant) and without, with random logits
and with forced ties (logits and biases on a coarse grid: equal choices, equal group scores, equal weights)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moeserve.models.experts.moe import CppSigmoidGroups, SigmoidGroups, choose_routing
from moeserve.models.numerics import Numerics
from moeserve.models.registry import get_architecture
from moeserve.models.spec import MoeSpec
from tests.kernels.ops import cpp_ops, lazy_ops

ops = lazy_ops()


@pytest.fixture(autouse=True)
def _kernels() -> None:
    cpp_ops()  # CppSigmoidGroups calls torch.ops.moeserve itself: load the library (or skip) before each test

CONFIGS = Path(__file__).parents[1] / "data" / "reference_configs"
MODELS = ["DeepSeek-V3", "Kimi-K2", "GLM-4.5-Air", "Nemotron-3-Nano-30B-A3B"]


def published_moe(name: str) -> MoeSpec:
    path = CONFIGS / f"{name}.json"
    config = json.loads(path.read_text())
    spec = get_architecture(config, str(path)).spec(config, str(path))
    assert spec.moe is not None and spec.moe.routing == "sigmoid_groups"
    return spec.moe


def with_groups(experts: int, n_group: int, topk_group: int, k: int, norm: bool) -> MoeSpec:
    """A made-up router of the same rule: odd sizes (a sigmoid tail), groups, no renormalisation."""
    return MoeSpec(num_experts=experts, top_k=k, intermediate_size=8, norm_topk_prob=norm, routing="sigmoid_groups",
                   router_bias=False, weights_in_fp32=True, expert_kind="swiglu", shared_intermediate_size=0,
                   router_fp32=True, n_group=n_group, topk_group=topk_group, routed_scaling_factor=1.7,
                   correction_bias=True)


def logits_and_bias(n: int, e: int, ties: bool, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    if ties:  # a grid of 5 logits and 3 biases: many equal choices, group scores and weights
        logits = torch.randint(-2, 3, (n, e), generator=gen).float() * 0.5
        bias = torch.randint(-1, 2, (e,), generator=gen).float() * 0.25
    else:
        logits = torch.randn(n, e, generator=gen) * 2
        bias = torch.randn(e, generator=gen) * 0.1
    return logits.to(dtype), bias


def assert_same_routing(moe: MoeSpec, logits: torch.Tensor, bias: torch.Tensor, numerics: Numerics) -> None:
    x = torch.zeros(logits.shape[0], 4)
    want = SigmoidGroups(moe, bias, numerics).route(x, logits)
    got = CppSigmoidGroups(moe, bias, numerics).route(x, logits)
    assert torch.equal(got.ids, want.ids), "expert ids (and their order)"
    assert torch.equal(got.token_of, want.token_of) and got.spans == want.spans, "grouping"
    assert got.weight_of.dtype == want.weight_of.dtype == torch.float32
    assert torch.equal(got.weight_of, want.weight_of), "weights"


@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", MODELS)
def test_published_routers_equal_the_torch_ops(name: str, dtype: torch.dtype, ties: bool) -> None:
    moe = published_moe(name)
    for n in (1, 2, 7, 16, 33, 64):
        logits, bias = logits_and_bias(n, moe.num_experts, ties, dtype, seed=n)
        for invariant in (True, False):
            assert_same_routing(moe, logits, bias, Numerics(cpp=True, batch_invariant=invariant))


@pytest.mark.parametrize("row_block", [16, 32])
@pytest.mark.parametrize("shape", [(20, 4, 2, 3, False), (10, 5, 3, 4, True), (12, 1, 1, 12, True),
                                   (256, 8, 4, 8, False)], ids=["e20", "e10", "k=e", "dsv3-no-norm"])
def test_made_up_routers_and_row_blocks(shape: tuple[int, int, int, int, bool], row_block: int) -> None:
    moe = with_groups(*shape)
    for n in (1, 3, 7, 31, 45):
        for ties in (False, True):
            logits, bias = logits_and_bias(n, moe.num_experts, ties, torch.float32, seed=n + 100)
            for invariant in (True, False):
                assert_same_routing(moe, logits, bias, Numerics(cpp=True, batch_invariant=invariant,
                                                                row_block=row_block))


def test_ties_really_tie() -> None:
    """The tie cases above are ties: rows whose k-th and (k+1)-th choices are equal, and group scores equal."""
    moe = published_moe("DeepSeek-V3")
    logits, bias = logits_and_bias(64, moe.num_experts, True, torch.float32, seed=5)
    choice = logits.sigmoid() + bias
    ranked = choice.sort(dim=-1, descending=True).values
    assert bool((ranked[:, moe.top_k - 1] == ranked[:, moe.top_k]).all())
    groups = choice.view(64, moe.n_group, -1).topk(2, dim=-1).values.sum(-1).sort(dim=-1, descending=True).values
    assert bool((groups[:, moe.topk_group - 1] == groups[:, moe.topk_group]).any())


def test_chosen_when_the_cpp_kernels_are_on() -> None:
    moe = published_moe("DeepSeek-V3")
    bias = torch.zeros(moe.num_experts)
    cpp = choose_routing(moe, Numerics(cpp=True, batch_invariant=True), correction_bias=bias)
    assert type(cpp) is CppSigmoidGroups and "C++ moe_route_noaux" in cpp.describe()
    assert cpp.why_not_stacked() is None  # the decode stack routes by the same op (DecodeStack.route_by_noaux)
    assert type(choose_routing(moe, Numerics(cpp=False, batch_invariant=True), correction_bias=bias)) is SigmoidGroups


def test_bad_groups_are_refused() -> None:
    with pytest.raises(RuntimeError, match="n_group must divide"):
        ops.moe_route_noaux(torch.zeros(2, 10), torch.zeros(10), 2, 3, 1, True, 1.0, 0)
