"""torch.ops.moeserve.linear_interleaved_int8 (csrc/dense_gemv_int8.cpp): int8 codes in the 4-row interleaved
layout times bf16 activations, against an independent float64 reference of (codes * scale) @ x (+ bias); each
output row independent of the batch and of the thread count; the portable path agrees with the fast one."""

from __future__ import annotations

import pytest
import torch

from moeserve.formats.int8 import quantize_int8_per_channel
from moeserve.models.layers.linear import Linear, pack_int8_rows, unpack_int8_rows
from moeserve.models.numerics import Numerics
from tests.kernels.ops import cpp_ops


def reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """float64 (x @ codes^T) * scale + bias: exact up to float64 rounding."""
    y = (x.double() @ codes.double().T) * scale.double()
    return y + bias.double() if bias is not None else y


def make(n: int, k: int, bias: bool, seed: int):  # noqa: ANN201
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen).bfloat16()
    codes, scale = quantize_int8_per_channel(w)
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    return codes, scale, b, gen


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize(("n", "k", "bias"), [(1, 32, False), (7, 64, True), (45, 96, False), (130, 256, True)])
def test_matches_float64_reference(portable: bool, n: int, k: int, bias: bool) -> None:
    ops = cpp_ops()
    codes, scale, b, gen = make(n, k, bias, n * k)
    packed = pack_int8_rows(codes)
    for m in range(1, 10):
        x = torch.randn(m, k, generator=gen).bfloat16()
        y = ops.linear_interleaved_int8(x, packed, scale, n, b, portable)
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        ref = reference(x, codes, scale, b)
        # fp32 accumulation then one bf16 rounding: within half a bf16 ulp (2^-8 relative) plus the fp32 sum's
        # error (K products of size |x||code| scale, relative 2^-24 each)
        fp32_err = k * (x.double().abs() @ codes.double().abs().T) * scale.double() * 2.0**-23
        tol = ref.abs() * 2.0**-8 + fp32_err + 1e-30
        assert ((y.double() - ref).abs() <= tol).all(), (m, (y.double() - ref).abs().max())


@pytest.mark.parametrize(("n", "k"), [(1, 32), (9, 64), (130, 96)])
def test_packing_round_trips(n: int, k: int) -> None:
    codes, _, _, _ = make(n, k, False, n + k)
    codes[0, :3] = torch.tensor([-127, 127, 0], dtype=torch.int8)  # the extremes and zero
    packed = pack_int8_rows(codes)
    assert packed.dtype == torch.int8 and packed.numel() == n * k
    assert torch.equal(unpack_int8_rows(packed, n, k), codes)


def test_wrong_layout_would_fail() -> None:
    """The reference is sensitive to the layout: plain (not interleaved) codes give other outputs."""
    ops = cpp_ops()
    codes, scale, _, gen = make(8, 64, False, 3)
    x = torch.randn(2, 64, generator=gen).bfloat16()
    y = ops.linear_interleaved_int8(x, codes.reshape(-1).contiguous(), scale, 8, None)
    assert (y.double() - reference(x, codes, scale, None)).abs().max() > 0.1


@pytest.mark.parametrize("threads", [1, 2])
def test_each_row_is_independent_of_the_batch(threads: int) -> None:
    ops = cpp_ops()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        codes, scale, b, gen = make(4099, 128, True, 11)  # big enough to be split between threads
        packed = pack_int8_rows(codes)
        x = torch.randn(37, 128, generator=gen).bfloat16()
        for portable in (False, True):
            batch = ops.linear_interleaved_int8(x, packed, scale, 4099, b, portable)
            for m in (0, 5, 36):
                alone = ops.linear_interleaved_int8(x[m : m + 1], packed, scale, 4099, b, portable)
                assert torch.equal(alone[0], batch[m])
            x3 = x[:6].reshape(2, 3, 128)  # leading dims are kept
            assert torch.equal(ops.linear_interleaved_int8(x3, packed, scale, 4099, b, portable).reshape(6, -1),
                               batch[:6])
    finally:
        torch.set_num_threads(before)


def test_fast_and_portable_paths_agree() -> None:
    ops = cpp_ops()
    codes, scale, b, gen = make(67, 160, True, 5)
    packed = pack_int8_rows(codes)
    x = torch.randn(9, 160, generator=gen).bfloat16()
    fast = ops.linear_interleaved_int8(x, packed, scale, 67, b, False).float()
    portable = ops.linear_interleaved_int8(x, packed, scale, 67, b, True).float()
    # the two only order the fp32 additions differently: at most one bf16 rounding step apart
    assert ((fast - portable).abs() <= fast.abs().clamp_min(1e-6) * 2.0**-7).all()


def test_int8_linear_layout() -> None:
    cpp_ops()
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(10, 64, generator=gen).bfloat16()
    lin = Linear(w, numerics=Numerics(cpp=True), int8=True)
    assert lin.layout == "int8"
    assert lin.nbytes == 10 * 64 + 10 * 4  # codes + float32 scales
    codes, scale = quantize_int8_per_channel(w)
    assert torch.equal(lin.weight, (codes.float() * scale[:, None]).bfloat16())  # dequantized copy
    x = torch.randn(3, 64, generator=gen).bfloat16()
    assert (lin(x).double() - reference(x, codes, scale, None)).abs().max() < 0.05
    assert Linear(w, numerics=Numerics(), int8=True).layout != "int8"  # int8 only with the C++ kernels
    assert Linear(w.float(), numerics=Numerics(cpp=True), int8=True).layout != "int8"  # and bf16 compute
    cpp = Numerics(cpp=True)
    assert Linear(torch.randn(4, 48).bfloat16(), numerics=cpp, int8=True).layout != "int8"  # and K % 32 == 0
