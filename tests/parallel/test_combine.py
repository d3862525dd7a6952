"""Expert parallelism's combine (models/experts/remote.py), in one process: the layer's pairs split among ranks as
the head splits them, each rank's share computed as a worker computes it (compute_share, on that rank's units only),
and combined by the head: bit for bit the single-process kernel's output, for contiguous and round-robin ownership,
bf16 and fp32 weights, the torch loop and (where built) the C++ op. The negative control sums per-rank partial
sums, as vLLM and SGLang do, and differs at top-4: the exact test can fail."""

from __future__ import annotations

import pytest
import torch

from moeserve.models.experts.kernels import RoutedTokens, TorchExperts
from moeserve.models.experts.remote import combine, compute_share, split_pairs
from moeserve.models.experts.unit_math import SwiGLUMath
from moeserve.models.numerics import Numerics
from moeserve.parallel.ownership import assign_experts, owned
from tests.models.test_batched_experts import E, routing, units


def in_ranks(kernel, routed, w, owners: list[int], ranks: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The head's combine of every rank's compute_share (each rank keyed by its local expert index)."""
    shares = split_pairs(routed, torch.tensor(owners), ranks)
    results = []
    for r, share in enumerate(shares):
        mine = owned(owners, r)
        local_of = {e: i for i, e in enumerate(mine)}
        tokens = routed.token_of[share.pairs].long()
        rows = torch.unique(tokens)
        starts = {e: lo for e, (lo, _) in routed.spans.items()}
        expert = torch.tensor([max(e for e, s in starts.items() if s <= p) for p in share.pairs.tolist()])
        local = torch.tensor([local_of[int(e)] for e in expert], dtype=torch.int64)
        chunks = [[(local_of[e], w[e]) for e in sorted(set(expert.tolist()))]]
        results.append(compute_share(kernel, chunks, routed.x[rows], local, torch.searchsorted(rows, tokens),
                                     share.lead, routed.weight_of[share.pairs], routed.num_tokens))
    out = torch.zeros_like(routed.x)
    combine(out, routed, shares, results)
    return out


def partial_sums(kernel, routed, w, owners: list[int], ranks: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """vLLM / SGLang's combine: each rank sums its experts' outputs per token, the head adds the partial sums."""
    out = torch.zeros_like(routed.x)
    for r in range(ranks):
        part = torch.zeros_like(routed.x)
        kernel.run(part, routed, [[(e, w[e]) for e in routed.experts if owners[e] == r]])
        out += part
    return out


@pytest.mark.parametrize("mode", ["contiguous", "round_robin"])
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.bfloat16])
def test_split_combine_equals_one_process_and_partial_sums_do_not(mode: str, ranks: int,
                                                                  weights_dtype: torch.dtype) -> None:
    kernel = TorchExperts(SwiGLUMath(), Numerics(batch_invariant=True))
    w = units(torch.bfloat16)
    owners = assign_experts(E, [1.0 + r for r in range(ranks)], mode)
    for n, seed in ((1, 0), (5, 1), (40, 2)):
        routed = routing(n, seed, torch.bfloat16)
        routed = type(routed)(routed.x, routed.ids, routed.token_of, routed.weight_of.to(weights_dtype),
                              routed.spans)
        ref = torch.zeros_like(routed.x)
        kernel.run(ref, routed, [[(e, w[e]) for e in routed.experts]])
        assert torch.equal(in_ranks(kernel, routed, w, owners, ranks), ref), f"{n} tokens"
    # the control: 40 tokens of 4 experts each, partial sums per rank then added
    assert not torch.equal(partial_sums(kernel, routed, w, owners, ranks), ref)


def test_leading_run_and_rest() -> None:
    """Token 0's experts 1, 2 (rank 0) then 5 (rank 1): rank 0 leads with {1, 2}; rank 1's 5 is a rest pair.
    Token 1's experts 4 (rank 1), 6 (rank 1), 7 (rank 1) all lead on rank 1."""
    owners = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    # pairs by expert: 1:[t0], 2:[t0], 4:[t1], 5:[t0], 6:[t1], 7:[t1]
    token_of = torch.tensor([0, 0, 1, 0, 1, 1])
    counts = [0, 1, 1, 0, 1, 1, 1, 1]
    routed = RoutedTokens.from_counts(torch.zeros(2, 4), torch.empty(0), token_of, torch.ones(6), counts)
    r0, r1 = split_pairs(routed, owners, 2)
    assert r0.pairs.tolist() == [0, 1] and r0.lead.tolist() == [True, True]
    assert r1.pairs.tolist() == [2, 3, 4, 5] and r1.lead.tolist() == [True, False, True, True]
