"""The routing op (csrc/routing.cpp) against the torch ops MoEBlock runs without the C++ kernels and against float64:
the same expert ids (ties broken as torch.topk breaks them; only near-ties closer than the fp32 softmax's own error
may pick differently), weights within a few fp32 ulps of float64 (one step of the 16-bit dtype when rounded to it),
and the pairs grouped exactly as a stable argsort groups them."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.ops import lazy_ops

ops = lazy_ops()


def torch_reference(logits: torch.Tensor, k: int, mode: int, norm: bool, fp32_weights: bool):
    if mode == 1:
        top, ids = torch.topk(logits, k, dim=-1)
        weights = torch.softmax(top, dim=-1, dtype=top.dtype)
    else:
        top, ids = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), k, dim=-1)
        if norm:
            top = top / top.sum(dim=-1, keepdim=True)
        weights = top if fp32_weights else top.to(logits.dtype)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return order // k, weights.reshape(-1)[order].float(), torch.bincount(flat, minlength=logits.shape[1]), ids


def reference64(logits: torch.Tensor, ids: torch.Tensor, mode: int, norm: bool) -> torch.Tensor:
    """float64 weights [N, k] of the experts `ids` picked."""
    x = logits.double()
    if mode == 1:
        return torch.softmax(x.gather(1, ids), dim=-1)
    top = torch.softmax(x, dim=-1).gather(1, ids)
    return top / top.sum(dim=-1, keepdim=True) if norm else top


def check(logits: torch.Tensor, k: int, mode: int, norm: bool, fp32_weights: bool, exact_ids: bool = False) -> None:
    token_of, weight_of, counts, ids = ops.moe_route_pairs(logits, k, mode, norm, fp32_weights)
    want_token_of, _, want_counts, want_ids = torch_reference(logits, k, mode, norm, fp32_weights)
    n, e = logits.shape
    # Expert choice: torch.topk's, except where the k-th and (k+1)-th candidates are closer than the error of an
    # fp32 softmax (then either pick is right).
    score = torch.softmax(logits.double(), dim=-1) if mode == 0 else logits.double()
    ranked = score.sort(dim=-1, descending=True).values
    clear = torch.ones(n, dtype=torch.bool)
    if k < e and not exact_ids:
        clear = (ranked[:, k - 1] - ranked[:, k]) > 1e-6 * ranked[:, k - 1].abs()
    assert torch.equal(ids[clear], want_ids[clear]), "ids"
    if bool(clear.all()):
        assert torch.equal(token_of, want_token_of) and torch.equal(counts, want_counts), "grouping"
    # Grouping of our own ids: a stable sort by expert.
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    assert torch.equal(token_of, order // k) and torch.equal(counts, torch.bincount(flat, minlength=e))
    weights = torch.empty(n * k, dtype=torch.float32)
    weights[order] = weight_of
    ref = reference64(logits, ids, mode, norm).reshape(-1)
    rounded = not fp32_weights or mode == 1
    # fp32 arithmetic: exp and division within an ulp each, and the sums of e (and k) terms in order within
    # (e + k) units of 2^-24 (the classic bound for a sequential sum); rounding to a 16-bit dtype adds half its step.
    fp32_bound = (e + k + 4) * 2.0**-24
    half_step = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 0.0}[logits.dtype]  # relative
    tol = fp32_bound + (half_step if rounded else 0.0)
    assert ((weights.double() - ref).abs() <= tol * ref.abs() + 1e-30).all(), "weights"
    if rounded and logits.dtype != torch.float32:  # a weight is a value of the dtype
        assert torch.equal(weights, weights.to(logits.dtype).float())


@pytest.mark.parametrize("n", [1, 3, 17, 100])
@pytest.mark.parametrize("e,k", [(8, 1), (8, 2), (32, 4), (128, 8)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("mode,norm,fp32_weights", [(0, True, False), (0, False, False), (0, True, True),
                                                    (1, False, False)])
def test_route_against_torch_and_float64(n, e, k, dtype, mode, norm, fp32_weights):
    gen = torch.Generator().manual_seed(n * 1000 + e + k)
    logits = (torch.randn(n, e, generator=gen) * 2).to(dtype)
    check(logits, k, mode, norm, fp32_weights)


def test_ties_and_grouping_order():
    """bf16 logits with ties (coarse values): the same ids as torch.topk; pairs of an expert in token order."""
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.5], [2.0, 2.0, 2.0, 2.0], [0.0, 3.0, 1.0, 3.0]]).bfloat16()
    check(logits, 2, 0, True, False, exact_ids=True)
    token_of, weight_of, counts, ids = ops.moe_route_pairs(logits, 2, 0, True, False)
    start = 0
    for c in counts.tolist():  # within each expert's run, tokens ascend
        run = token_of[start : start + c]
        assert torch.equal(run, run.sort().values)
        start += c
    assert start == token_of.numel() == 6


@pytest.mark.parametrize("e,k", [(8, 2), (32, 4), (128, 8), (512, 4), (256, 1)])  # 512/4 and 256/1: partial sort
def test_many_ties_pick_what_torch_topk_picks(e, k):
    """Coarse logits (a few distinct values): most rows tie at the k-th place; ids and order as torch.topk."""
    gen = torch.Generator().manual_seed(e * 10 + k)
    logits = torch.randint(0, 3, (40, e), generator=gen).float().bfloat16()
    for mode, norm in ((0, True), (0, False), (1, False)):
        check(logits, k, mode, norm, False, exact_ids=True)


def test_nan_logits_do_not_crash():
    logits = torch.tensor([[0.5, float("nan"), 1.0, 2.0]])
    token_of, weight_of, counts, ids = ops.moe_route_pairs(logits, 2, 1, False, False)
    assert ids.tolist() == torch.topk(logits, 2).indices.tolist() and int(counts.sum()) == 2


def test_empty_batch_and_bad_input():
    token_of, weight_of, counts, ids = ops.moe_route_pairs(torch.zeros(0, 8), 2, 0, True, False)
    assert token_of.numel() == 0 and weight_of.numel() == 0 and counts.eq(0).all() and ids.shape == (0, 2)
    with pytest.raises(RuntimeError, match="top_k"):
        ops.moe_route_pairs(torch.zeros(2, 8), 9, 0, True, False)
    with pytest.raises(RuntimeError, match="mode"):
        ops.moe_route_pairs(torch.zeros(2, 8), 2, 2, True, False)
    with pytest.raises(RuntimeError, match="logits"):
        ops.moe_route_pairs(torch.zeros(8), 2, 0, True, False)

