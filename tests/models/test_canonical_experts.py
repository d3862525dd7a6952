"""The GPU side's expert kernel (moeserve/models/experts/canonical.py, torch ops in the canonical order) against
the CPU's C++ expert ops, bit for bit: bf16 and int8 SwiGLU units, row-interleaved and [out, in], with weights
holding denormals, zeros and large values, decode and prefill-sized batches. This equality is what lets the
hybrid placement compute an expert on either device without changing a bit (docs/design/gpu.md)."""

from __future__ import annotations

import pytest
import torch

import moeserve.models.experts.canonical as canonical
from moeserve.models.experts.canonical import CanonicalExperts, canonical_dots
from moeserve.models.experts.kernels import CppInterleavedSwiGLU, CppSwiGLU, RoutedTokens, TorchExperts
from moeserve.models.experts.unit_math import FusedUnits, SwiGLUMath
from moeserve.models.layers.linear import interleave_rows, pack_int8_rows
from moeserve.models.numerics import Numerics
from tests.kernels.ops import cpp_ops
from tests.kernels.test_canonical_isa import canonical_dots as reference_dots
from tests.kernels.test_canonical_isa import one_thread

# hidden, intermediate (8 and 7 chunks: long enough that the summation order shows in bf16), experts
H, INTER, E = 256, 224, 5


def routing(n: int, seed: int) -> RoutedTokens:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, H, generator=gen) * 0.5).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(n)])  # [n, 2] distinct experts
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    weights = torch.rand(n, 2, generator=gen).bfloat16().reshape(-1)[order]
    return RoutedTokens.from_counts(x, ids, order // 2, weights, torch.bincount(flat, minlength=E).tolist())


def units(int8: bool, interleaved: bool, seed: int = 3) -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(seed)
    made = []
    for _ in range(E):
        if int8:
            gu, dn = (torch.randint(-127, 128, s, generator=gen, dtype=torch.int8) for s in ((2 * INTER, H), (H, INTER)))
            scales = [torch.rand(n, generator=gen) * 0.01 for n in (2 * INTER, H)]
            pack = pack_int8_rows if interleaved else (lambda t: t)
            made.append((pack(gu), scales[0], pack(dn), scales[1]))
        else:
            gu, dn = edgy((2 * INTER, H), gen), edgy((H, INTER), gen)
            made.append(tuple(interleave_rows(t) if interleaved else t for t in (gu, dn)))
    return made


def edgy(shape: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    """bf16 weights with denormals (read as zeros by the canonical F) and signed zeros among normal values."""
    v = torch.randn(shape, generator=gen) * 0.2
    pick = torch.rand(shape, generator=gen)
    v = torch.where(pick < 0.05, torch.randint(-100, 100, shape, generator=gen) * 2.0**-133, v)
    return torch.where((pick >= 0.05) & (pick < 0.08), v * 0.0, v).bfloat16()


def fused(int8: bool, interleaved: bool) -> FusedUnits:
    return FusedUnits(interleaved, 0, 1, 2, 3) if int8 else FusedUnits(interleaved)


def run(kernel, routed: RoutedTokens, w: list) -> torch.Tensor:  # type: ignore[no-untyped-def]
    out = torch.zeros_like(routed.x)
    kernel.run(out, routed, [[(e, w[e]) for e in routed.experts]])
    return out


def test_canonical_dots_are_the_kernel_tests_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    w, x = edgy((12, 96), gen), edgy((5, 96), gen)
    assert torch.equal(canonical_dots(w, x).view(torch.int32), reference_dots(w, x).view(torch.int32))


@pytest.mark.parametrize("int8", [False, True], ids=["bf16", "int8"])
@pytest.mark.parametrize(("interleaved", "tokens"), [(True, 1), (True, 20), (False, 3)],
                         ids=["interleaved-decode", "interleaved-prefill", "plain"])
def test_canonical_experts_equal_the_cpp_op_bit_for_bit(int8: bool, interleaved: bool, tokens: int) -> None:
    cpp_ops()
    w, routed = units(int8, interleaved), routing(tokens, seed=tokens)
    math = SwiGLUMath()
    numerics = Numerics(cpp=True, batch_invariant=True)
    cpp = (CppInterleavedSwiGLU(math, fused(int8, interleaved)) if interleaved
           else CppSwiGLU(fused(int8, interleaved), TorchExperts(math, numerics)))
    ours = CanonicalExperts(math, fused(int8, interleaved))
    with one_thread():
        got = run(ours, routed, w)
    want = run(cpp, routed, w)
    assert want.isfinite().all() and want.abs().sum() > 0
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_the_order_matters_here_a_plain_fp32_sum_differs() -> None:
    """The negative control: the same math with the dots summed in plain fp32 order (as a GEMM might) gives other
    bits on these inputs, so the equality above is the canonical order's, not the inputs' luck."""
    cpp_ops()
    w, routed = units(False, True), routing(20, seed=20)
    ours = CanonicalExperts(SwiGLUMath(), fused(False, True))
    with one_thread():
        want = run(ours, routed, w)

    original = canonical.canonical_dots
    canonical.canonical_dots = lambda w, x: x.float() @ w.float().T  # type: ignore[assignment]
    try:
        got = run(ours, routed, w)
    finally:
        canonical.canonical_dots = original
    assert not torch.equal(got.view(torch.int16), want.view(torch.int16))
