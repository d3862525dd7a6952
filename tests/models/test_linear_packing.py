"""Linear's oneDNN-packed bf16 path gives the same bits as F.linear on the plain weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeserve.models.layers import Linear, _can_pack


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
