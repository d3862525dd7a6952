"""Linear's weight layouts: oneDNN-packed bf16 gives the same bits as F.linear on the plain weight; the C++ GEMV's
row-interleaved layout round-trips and is as accurate as F.linear, each row independent of the batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeserve.models.layers.linear import Linear, _can_pack
from moeserve.models.numerics import Numerics


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("out_f", "in_f", "bias"), [(96, 64, False), (32, 128, True), (1, 64, False)])
def test_packed_linear_is_bit_identical(threads, out_f, in_f, bias):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(out_f * in_f)
        w = torch.randn(out_f, in_f, generator=gen).bfloat16()
        b = torch.randn(out_f, generator=gen).bfloat16() if bias else None
        lin = Linear(w.clone(), b)
        for rows in (1, 3, 8, 37):
            x = torch.randn(rows, in_f, generator=gen).bfloat16()
            assert torch.equal(lin(x), F.linear(x, w, b))
        x3 = torch.randn(2, 5, in_f, generator=gen).bfloat16()  # leading dims are kept
        assert torch.equal(lin(x3), F.linear(x3, w, b))
    finally:
        torch.set_num_threads(before)


def test_only_bf16_cpu_matrices_are_packed():
    assert not Linear(torch.randn(8, 8)).packed  # fp32 keeps F.linear: parity tests with transformers run in fp32
    assert not _can_pack(torch.randn(8, dtype=torch.float32).bfloat16())  # 1-D
    lin = Linear(torch.randn(8, 8).bfloat16())
    assert lin.packed == (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert lin.nbytes == 8 * 8 * 2
    w = torch.randn(8, 8).bfloat16()
    assert torch.equal(Linear(w.clone()).weight, w)  # a plain copy back, whatever the layout inside


def _gemv_ops():  # noqa: ANN202
    from tests.kernels.ops import cpp_ops

    ops = cpp_ops()
    if not ops.gemv_bf16_supported():
        pytest.skip("this CPU has no AVX512-BF16")
    return ops


@pytest.mark.parametrize(("n", "k"), [(6, 64), (1, 32), (37, 96), (8, 1024)])
def test_interleave_round_trips(n, k):
    from moeserve.models.layers.linear import deinterleave_rows, interleave_rows

    w = torch.randn(n, k).bfloat16()
    packed = interleave_rows(w)
    assert packed.numel() == n * k
    assert torch.equal(deinterleave_rows(packed, n, k), w)
    if n >= 4 and k >= 64:  # block 0: chunk 0 of rows 0..3 side by side, then chunk 1 of rows 0..3
        assert torch.equal(packed[:128], w[:4, :32].reshape(-1))
        assert torch.equal(packed[128:160], w[0, 32:64])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("out_f", "in_f", "bias"), [(1536, 1024, False), (37, 96, True), (2, 64, False)])
def test_interleaved_linear_against_fp64(threads, out_f, in_f, bias):
    """As close to the exact product as F.linear, each row independent of the batch and of the thread count."""
    _gemv_ops()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(out_f + in_f)
        w = torch.randn(out_f, in_f, generator=gen).bfloat16()
        b = torch.randn(out_f, generator=gen).bfloat16() if bias else None
        lin = Linear(w.clone(), b, Numerics(cpp=True))
        assert lin.layout == "interleaved" and not lin.packed
        assert torch.equal(lin.weight, w)
        x_all = torch.randn(70, in_f, generator=gen).bfloat16()
        alone = lin(x_all[:1])
        for rows in (1, 3, 8, 33, 70):  # 33, 70: more than one 32-row tile
            x = x_all[:rows]
            got = lin(x)
            exact = x.double() @ w.double().T + (0 if b is None else b.double())
            ref = F.linear(x, w, b)
            # one rounding of a (differently ordered) fp32 sum: within a bf16 step of F.linear's result
            assert (got.double() - exact).abs().max() <= (ref.double() - exact).abs().max() * 1.01 + 1e-6
            assert (got != ref).float().mean() < 0.01
            assert torch.equal(got[:1], alone)
        x3 = x_all[:10].reshape(2, 5, in_f)
        assert torch.equal(lin(x3), lin(x_all[:10]).reshape(2, 5, out_f))
    finally:
        torch.set_num_threads(before)


def test_interleaved_layout_only_where_it_applies():
    _gemv_ops()
    assert Linear(torch.randn(8, 64).bfloat16(), numerics=Numerics(cpp=True)).layout == "interleaved"
    assert Linear(torch.randn(8, 48).bfloat16(), numerics=Numerics(cpp=True)).layout != "interleaved"  # 48 % 32 != 0
    assert Linear(torch.randn(8, 64), numerics=Numerics(cpp=True)).layout == "plain"  # fp32
    assert Linear(torch.randn(8, 64).bfloat16()).layout != "interleaved"  # C++ kernels off
