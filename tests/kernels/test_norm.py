"""The C++ RMSNorm ops (moeserve/kernels/csrc/norm.cpp) against the torch functions they replace.

The ops take the same steps and roundings as `rms_norm` / `rms_norm_fp32_scale`; only the fp32 sum of squares
may be added in another order, so a bf16 result may differ from torch's by one bf16 step, rarely, and an fp32
one by a few fp32 ulps. The residual add is bit-exact.
"""

from __future__ import annotations

import pytest
import torch

from moeserve.models.layers.base import rms_norm, rms_norm_fp32_scale
from tests.kernels.ops import cpp_ops


@pytest.fixture(scope="module")
def ops():  # noqa: ANN201 - torch's op namespace
    return cpp_ops()
EPS = 1e-6


def assert_norm_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.dtype == ref.dtype and got.shape == ref.shape
    if ref.dtype == torch.bfloat16:
        # at most one bf16 step apart, and rarely so
        torch.testing.assert_close(got.float(), ref.float(), rtol=2**-7, atol=1e-30)
        assert (got != ref).float().mean() < 0.01
    else:
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 8, 37])
def test_rms_norm_matches_torch(ops, dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 1024, generator=gen) * 3).to(dtype)
    w = torch.randn(1024, generator=gen).to(dtype)
    assert_norm_close(ops.rms_norm(x, w, EPS, False), rms_norm(x, w, EPS))
    w32 = torch.randn(1024, generator=gen)  # gpt-oss keeps the weight in fp32 and scales before the cast
    assert_norm_close(ops.rms_norm(x, w32, EPS, True), rms_norm_fp32_scale(x, w32, EPS))


def test_rms_norm_bf16_equals_torch_on_most_rows(ops) -> None:
    """The bf16 result is the torch result bit for bit almost everywhere (the steps are the same)."""
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(64, 2048, generator=gen) * 10).bfloat16()
    w = torch.randn(2048, generator=gen).bfloat16()
    assert (ops.rms_norm(x, w, EPS, False) != rms_norm(x, w, EPS)).sum() <= 64 * 2048 // 1000


def test_rms_norm_strided_rows_and_leading_dims(ops) -> None:
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(5, 96, generator=gen).bfloat16()
    x = wide[:, 16:80]  # rows 96 apart, last dim contiguous
    w = torch.randn(64, generator=gen).bfloat16()
    assert_norm_close(ops.rms_norm(x, w, EPS, False), rms_norm(x, w, EPS))
    x3 = torch.randn(2, 3, 4, 64, generator=gen).bfloat16()  # per-head use: [N, heads, d]
    out = ops.rms_norm(x3, w, EPS, False)
    assert out.shape == x3.shape
    assert_norm_close(out, rms_norm(x3, w, EPS))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_add_rms_norm_updates_residual_in_place(ops, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    residual = (torch.randn(8, 512, generator=gen) * 5).to(dtype)
    x = torch.randn(8, 512, generator=gen).to(dtype)
    w = torch.randn(512, generator=gen).to(dtype)
    h_ref = residual + x
    out = ops.add_rms_norm_(residual, x, w, EPS, False)
    assert torch.equal(residual, h_ref)  # the add rounds once, as torch's
    assert_norm_close(out, rms_norm(h_ref, w, EPS))


def test_bad_arguments_are_errors(ops) -> None:
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.rms_norm(x, torch.randn(32).bfloat16(), EPS, False)
    with pytest.raises(RuntimeError, match="bf16 or fp32"):
        ops.rms_norm(x.half(), torch.randn(64).half(), EPS, False)
    with pytest.raises(RuntimeError, match="same shape"):
        ops.add_rms_norm_(x, torch.randn(1, 64).bfloat16(), torch.randn(64).bfloat16(), EPS, False)
