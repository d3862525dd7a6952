"""The routing op (csrc/routing.cpp) against the torch ops MoEBlock runs without the C++ kernels: the same expert
ids, the same weights bit for bit, and the pairs grouped exactly as a stable argsort groups them."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.ops import cpp_ops

ops = cpp_ops()


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


@pytest.mark.parametrize("n", [1, 3, 17, 100])
@pytest.mark.parametrize("e,k", [(8, 1), (8, 2), (32, 4), (128, 8)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode,norm,fp32_weights", [(0, True, False), (0, False, False), (0, True, True),
                                                    (1, False, False)])
def test_route_equals_the_torch_ops(n, e, k, dtype, mode, norm, fp32_weights):
    gen = torch.Generator().manual_seed(n * 1000 + e + k)
    logits = (torch.randn(n, e, generator=gen) * 2).to(dtype)
    got = ops.moe_route_pairs(logits, k, mode, norm, fp32_weights)
    want = torch_reference(logits, k, mode, norm, fp32_weights)
    for name, a, b in zip(("token_of", "weight_of", "counts", "ids"), got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_ties_and_grouping_order():
    """bf16 logits with ties (coarse values): the same ids as torch.topk; pairs of an expert in token order."""
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.5], [2.0, 2.0, 2.0, 2.0], [0.0, 3.0, 1.0, 3.0]]).bfloat16()
    token_of, weight_of, counts, ids = ops.moe_route_pairs(logits, 2, 0, True, False)
    ref = torch_reference(logits, 2, 0, True, False)
    assert torch.equal(ids, ref[3]) and torch.equal(token_of, ref[0]) and torch.equal(weight_of, ref[1])
    start = 0
    for c in counts.tolist():  # within each expert's run, tokens ascend
        run = token_of[start : start + c]
        assert torch.equal(run, run.sort().values)
        start += c
    assert start == token_of.numel() == 6


def test_empty_batch_and_bad_input():
    token_of, weight_of, counts, ids = ops.moe_route_pairs(torch.zeros(0, 8), 2, 0, True, False)
    assert token_of.numel() == 0 and weight_of.numel() == 0 and counts.eq(0).all() and ids.shape == (0, 2)
    with pytest.raises(RuntimeError, match="top_k"):
        ops.moe_route_pairs(torch.zeros(2, 8), 9, 0, True, False)
    with pytest.raises(RuntimeError, match="mode"):
        ops.moe_route_pairs(torch.zeros(2, 8), 2, 2, True, False)
    with pytest.raises(RuntimeError, match="logits"):
        ops.moe_route_pairs(torch.zeros(8), 2, 0, True, False)


@pytest.mark.parametrize("e,k", [(8, 2), (32, 4), (128, 8), (512, 4), (256, 1)])  # 512/4 and 256/1: partial sort
def test_many_ties_pick_what_torch_topk_picks(e, k):
    """Coarse logits (a few distinct values): most rows tie at the k-th place; ids, order and weights as torch."""
    gen = torch.Generator().manual_seed(e * 10 + k)
    logits = torch.randint(0, 3, (40, e), generator=gen).float().bfloat16()
    for mode, norm in ((0, True), (0, False), (1, False)):
        got = ops.moe_route_pairs(logits, k, mode, norm, False)
        want = torch_reference(logits, k, mode, norm, False)
        for name, a, b in zip(("token_of", "weight_of", "counts", "ids"), got, want):
            assert torch.equal(a, b), (name, mode, norm)
