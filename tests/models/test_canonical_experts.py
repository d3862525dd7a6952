"""The GPU side's expert kernel (moeserve/models/experts/canonical.py, torch ops in the canonical order) against
the CPU's C++ expert ops, bit for bit: bf16 and int8 SwiGLU units, row-interleaved and [out, in], with weights
holding denormals, zeros and large values, decode and prefill-sized batches. This equality is what lets the
hybrid placement compute an expert on either device without changing a bit (docs/design/gpu.md)."""

from __future__ import annotations

import pytest
import torch

from moeserve.models.experts.canonical import CanonicalExperts, canonical_dots
from moeserve.models.experts.kernels import CppInterleavedSwiGLU, CppSwiGLU, RoutedTokens, TorchExperts
from moeserve.models.experts.unit_math import FusedUnits, SwiGLUMath
from moeserve.models.layers.linear import interleave_rows, pack_int8_rows
from moeserve.models.numerics import Numerics
from tests.kernels.ops import cpp_ops
from tests.kernels.test_canonical_isa import canonical_dots as reference_dots

H, I, E = 64, 96, 5  # hidden, intermediate (3 chunks), experts


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
            gu, dn = (torch.randint(-127, 128, s, generator=gen, dtype=torch.int8) for s in ((2 * I, H), (H, I)))
            scales = [torch.rand(n, generator=gen) * 0.01 for n in (2 * I, H)]
            pack = pack_int8_rows if interleaved else (lambda t: t)
            made.append((pack(gu), scales[0], pack(dn), scales[1]))
        else:
            gu, dn = edgy((2 * I, H), gen), edgy((H, I), gen)
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
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "plain"])
@pytest.mark.parametrize("tokens", [1, 3, 70])
def test_canonical_experts_equal_the_cpp_op_bit_for_bit(int8: bool, interleaved: bool, tokens: int) -> None:
    cpp_ops()
    w, routed = units(int8, interleaved), routing(tokens, seed=tokens)
    math = SwiGLUMath()
    numerics = Numerics(cpp=True, batch_invariant=True)
    cpp = (CppInterleavedSwiGLU(math, fused(int8, interleaved)) if interleaved
           else CppSwiGLU(fused(int8, interleaved), TorchExperts(math, numerics)))
    ours = CanonicalExperts(math, fused(int8, interleaved))
    got, want = run(ours, routed, w), run(cpp, routed, w)
    assert want.isfinite().all() and want.abs().sum() > 0
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
