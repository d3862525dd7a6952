"""The gated delta rule (models/mixers/gated_delta_rule.py) against transformers' reference torch implementations
(torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule in its qwen3_next modeling), in fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeserve.models.mixers.gated_delta_rule import CHUNK, chunk_form, l2norm, recurrent_step, sum_rows


def inputs(n: int, heads: int = 4, dk: int = 16, dv: int = 8, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(n, heads, dk, generator=gen) for _ in range(2))
    v = torch.randn(n, heads, dv, generator=gen)
    g = -torch.rand(n, heads, generator=gen) * 2  # log decay <= 0
    beta = torch.rand(n, heads, generator=gen)
    state = torch.randn(heads, dk, dv, generator=gen) * 0.3
    return q, k, v, g, beta, state


def reference(kind: str, q, k, v, g, beta, state):  # noqa: ANN001
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    fn = m.torch_chunk_gated_delta_rule if kind == "chunk" else m.torch_recurrent_gated_delta_rule
    fn = getattr(fn, "__wrapped__", fn)
    out, final = fn(q[None], k[None], v[None], g=g[None], beta=beta[None], initial_state=state[None].clone(),
                    output_final_state=True, use_qk_l2norm_in_kernel=True)
    return out[0], final[0]


@pytest.mark.parametrize("n", [1, 5, CHUNK, CHUNK + 7, 3 * CHUNK - 1])
def test_chunk_form_equals_transformers(n: int) -> None:
    q, k, v, g, beta, state = inputs(n)
    ref_out, ref_state = reference("chunk", q, k, v, g, beta, state)
    ours_state = state.clone()
    out = chunk_form(l2norm(q), l2norm(k), v, g, beta, ours_state)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours_state, ref_state, rtol=1e-5, atol=1e-5)


def test_recurrent_step_equals_transformers_and_the_chunk_form() -> None:
    q, k, v, g, beta, state = inputs(9, seed=1)
    ref_out, ref_state = reference("recurrent", q, k, v, g, beta, state)
    ours_state = state.clone()
    outs = [recurrent_step(l2norm(q[t]), l2norm(k[t]), v[t], g[t].exp(), beta[t], ours_state) for t in range(9)]
    torch.testing.assert_close(torch.stack(outs), ref_out, rtol=1e-6, atol=1e-6)  # the sums in another order
    torch.testing.assert_close(ours_state, ref_state, rtol=1e-6, atol=1e-6)
    chunk_state = state.clone()
    torch.testing.assert_close(chunk_form(l2norm(q), l2norm(k), v, g, beta, chunk_state), ref_out, rtol=1e-5,
                               atol=1e-5)


def test_chunks_carry_the_state() -> None:
    """Two calls cut at a multiple of CHUNK give the bits of one call (state carried between them)."""
    q, k, v, g, beta, state = inputs(2 * CHUNK + 9, seed=2)
    q, k = l2norm(q), l2norm(k)
    whole_state, parts_state = state.clone(), state.clone()
    whole = chunk_form(q, k, v, g, beta, whole_state)
    first = chunk_form(q[:CHUNK], k[:CHUNK], v[:CHUNK], g[:CHUNK], beta[:CHUNK], parts_state)
    rest = chunk_form(q[CHUNK:], k[CHUNK:], v[CHUNK:], g[CHUNK:], beta[CHUNK:], parts_state)
    assert torch.equal(torch.cat([first, rest]), whole) and torch.equal(parts_state, whole_state)
    # the decay matters: without it the outputs differ (the test can fail)
    assert not torch.allclose(chunk_form(q, k, v, torch.zeros_like(g), beta, state.clone()), whole, atol=1e-3)
    assert F.mse_loss(whole, torch.zeros_like(whole)) > 0


@pytest.mark.parametrize("n", [1, 2, 7, 16, 128])
def test_sum_rows_is_the_sum(n: int) -> None:
    x = torch.randn(3, n, 5, generator=torch.Generator().manual_seed(n))
    torch.testing.assert_close(sum_rows(x), x.sum(dim=-2), rtol=1e-5, atol=1e-5)
    if n == 7:  # the pairing it promises: ((x0 + x4) + (x2 + x6)) + ((x1 + x5) + x3)
        a = [x[..., i, :] for i in range(7)]
        assert torch.equal(sum_rows(x), ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + a[3]))
