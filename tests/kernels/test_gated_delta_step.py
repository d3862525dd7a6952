"""The C++ Gated DeltaNet decode step (csrc/gated_delta.cpp gated_delta_step_) against the torch step it replaces
(models/gated_delta_rule.recurrent_step): the same bits, for a batch of sequences in their own state slots, at the
tiny test shapes and Qwen3-Next's real ones (32 value heads of 128 x 128), several steps in a row."""

from __future__ import annotations

import pytest
import torch

from moeserve.models.mixers.gated_delta_rule import l2norm, recurrent_step
from tests.kernels.ops import cpp_ops


@pytest.mark.parametrize("heads,dk,dv", [(4, 16, 8), (32, 128, 128)], ids=["tiny", "qwen3-next"])
def test_decode_step_equals_the_torch_step(heads: int, dk: int, dv: int) -> None:
    ops = cpp_ops()
    gen = torch.Generator().manual_seed(heads)
    slots = torch.tensor([5, 0, 2])
    states = torch.randn(6, heads, dk, dv, generator=gen) * 0.2
    torch_states = states.clone()
    for _ in range(3):
        q = l2norm(torch.randn(3, heads, dk, generator=gen))
        k = l2norm(torch.randn(3, heads, dk, generator=gen))
        v = torch.randn(3, heads, dv, generator=gen)
        decay = (-torch.rand(3, heads, generator=gen) * 2).exp()
        beta = torch.rand(3, heads, generator=gen)
        got = ops.gated_delta_step_(q, k, v, decay, beta, states, slots)
        for b, slot in enumerate(slots.tolist()):
            ref = recurrent_step(q[b], k[b], v[b], decay[b], beta[b], torch_states[slot])
            assert torch.equal(got[b], ref), f"sequence {b}"
        assert torch.equal(states, torch_states)  # the slots in use updated alike, the others untouched
    assert not torch.equal(states[5], states[0])


def test_bad_inputs_are_refused() -> None:
    ops = cpp_ops()
    q = torch.zeros(1, 4, 16)
    with pytest.raises(RuntimeError, match="slot out of range"):
        ops.gated_delta_step_(q, q, torch.zeros(1, 4, 8), torch.ones(1, 4), torch.ones(1, 4),
                              torch.zeros(2, 4, 16, 8), torch.tensor([2]))
    with pytest.raises(RuntimeError, match="fp32"):
        ops.gated_delta_step_(q.bfloat16(), q, torch.zeros(1, 4, 8), torch.ones(1, 4), torch.ones(1, 4),
                              torch.zeros(2, 4, 16, 8), torch.tensor([0]))
