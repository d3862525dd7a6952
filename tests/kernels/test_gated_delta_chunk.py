"""The C++ chunk form of the gated delta rule (csrc/gated_delta_chunk.cpp gated_delta_chunk_), which prompt tokens
take when the C++ kernels are on, against transformers' torch_chunk_gated_delta_rule and the torch chunk form
(models/gated_delta_rule.chunk_form) in fp32, at the tiny test shapes and Qwen3-Next's real ones (32 value heads of
128 x 128), full and partial chunks, a state carried in. Not the torch form's bits (its GEMMs block the sums their
own way): consistent with itself instead, which is what the engine's exactness needs: a prompt cut on the 64 grid
gives the bits of one call, and the thread count changes no bit. The engine-level checks (chunked prefill == one
pass and batched / preempted == alone in bf16 default settings, the tiny Qwen3-Next against transformers) run with
the kernels on in tests/models/test_qwen3_next.py; the last test here checks they do take this op."""

from __future__ import annotations

import pytest
import torch

from moeserve.models.mixers.gated_delta import GatedDeltaNet, cpp_chunk_form
from moeserve.models.mixers.gated_delta_rule import CHUNK, chunk_form, l2norm
from tests.kernels.ops import lazy_ops
from tests.models.test_gated_delta_rule import inputs, reference

ops = lazy_ops()
SHAPES = {"tiny": (4, 16, 8), "odd": (3, 20, 36), "qwen3-next": (32, 128, 128)}


CASES = [(shape, n) for shape in ("tiny", "odd") for n in (1, 5, CHUNK, CHUNK + 7, 3 * CHUNK - 1)]
# the torch references take seconds per call at the real shape on a loaded 2-core machine: one case, slow tier
CASES.append(pytest.param("qwen3-next", CHUNK + 7, marks=pytest.mark.slow))


@pytest.mark.parametrize("shape,n", CASES)
def test_chunk_op_equals_transformers_and_the_torch_form(shape: str, n: int) -> None:
    heads, dk, dv = SHAPES[shape]
    q, k, v, g, beta, state = inputs(n, heads, dk, dv, seed=n)
    ref_out, ref_state = reference("chunk", q, k, v, g, beta, state)
    ours_state, torch_state = state.clone(), state.clone()
    out = ops.gated_delta_chunk_(l2norm(q), l2norm(k), v, g, beta, ours_state)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours_state, ref_state, rtol=1e-5, atol=1e-5)
    torch_out = chunk_form(l2norm(q), l2norm(k), v, g, beta, torch_state)
    torch.testing.assert_close(out, torch_out, rtol=1e-5, atol=1e-5)
    assert (out - ref_out).abs().max() < 1e-4 and float(out.abs().max()) > 0.05  # not vacuous


@pytest.mark.parametrize("shape", ["tiny", "qwen3-next"])
def test_a_prompt_cut_on_the_grid_gives_the_bits_of_one_call(shape: str) -> None:
    heads, dk, dv = SHAPES[shape]
    q, k, v, g, beta, state = inputs(3 * CHUNK + 9, heads, dk, dv, seed=2)
    q, k = l2norm(q), l2norm(k)
    whole_state, parts_state = state.clone(), state.clone()
    whole = ops.gated_delta_chunk_(q, k, v, g, beta, whole_state)
    parts = []
    for lo, hi in ((0, CHUNK), (CHUNK, 3 * CHUNK), (3 * CHUNK, 3 * CHUNK + 9)):
        parts.append(ops.gated_delta_chunk_(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], parts_state))
    assert torch.equal(torch.cat(parts), whole) and torch.equal(parts_state, whole_state)
    # the decay matters: without it the outputs differ (the test can fail)
    assert not torch.allclose(ops.gated_delta_chunk_(q, k, v, torch.zeros_like(g), beta, state.clone()), whole,
                              atol=1e-3)


def test_the_thread_count_changes_no_bit() -> None:
    q, k, v, g, beta, state = inputs(2 * CHUNK + 3, 32, 128, 128, seed=3)
    q, k = l2norm(q), l2norm(k)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, max(2, threads)):
            torch.set_num_threads(n)
            s = state.clone()
            outs.append((ops.gated_delta_chunk_(q, k, v, g, beta, s), s))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_bad_inputs_are_refused() -> None:
    q = torch.zeros(3, 4, 16)
    with pytest.raises(RuntimeError, match="shapes disagree"):
        ops.gated_delta_chunk_(q, q, torch.zeros(3, 4, 8), torch.zeros(3, 4), torch.zeros(3, 4), torch.zeros(4, 8, 8))
    with pytest.raises(RuntimeError, match="fp32"):
        ops.gated_delta_chunk_(q.bfloat16(), q, torch.zeros(3, 4, 8), torch.zeros(3, 4), torch.zeros(3, 4),
                               torch.zeros(4, 16, 8))


def test_the_engine_takes_it_with_the_kernels_on(tiny_checkpoint) -> None:
    from moeserve import LLM

    llm = LLM(str(tiny_checkpoint("qwen3_next")), skip_tokenizer_init=True)
    try:
        assert "C++ gated_delta_chunk_" in llm.engine.choices["linear attention"]
        mixers = [m for m in (layer.attn for layer in llm.engine.model.layers) if isinstance(m, GatedDeltaNet)]
        assert mixers and all(m.chunk_form is cpp_chunk_form for m in mixers)
    finally:
        llm.engine.close()
