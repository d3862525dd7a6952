"""interleave_rows_into (csrc/layout.cpp) writes exactly `layers.interleave_rows`, and refuses bad shapes."""

from __future__ import annotations

import pytest
import torch

from moeserve.models.layers.linear import interleave_rows
from tests.kernels.ops import lazy_ops

ops = lazy_ops()


@pytest.mark.parametrize("n,k", [(4, 32), (8, 96), (1024, 512), (512, 1536)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_equals_interleave_rows(n, k, dtype):
    w = torch.randn(n, k).to(dtype)
    dst = torch.empty(n * k, dtype=dtype)
    ops.interleave_rows_into(dst, w)
    assert torch.equal(dst, interleave_rows(w))


def test_bad_shapes():
    with pytest.raises(RuntimeError, match="N % 4 == 0"):
        ops.interleave_rows_into(torch.empty(6 * 32, dtype=torch.bfloat16), torch.zeros(6, 32, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="2-byte"):
        ops.interleave_rows_into(torch.empty(4 * 32), torch.zeros(4, 32))
