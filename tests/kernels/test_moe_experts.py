"""The fused SwiGLU expert op (csrc/moe_experts.cpp) against independent references.

- float64 reference: the exact math (no rounding in between), for every shape, dtype and routing.
- the torch loop of MoEBlock (`swiglu_expert` + weighted add, in the compute dtype): the op must be at least as
  close to the float64 result as that loop is (it takes the same roundings; only the order of the additions
  inside each dot product differs), and for bf16 mostly the same bits.
- int8: the op computes dot(codes, x) * scale; compared with float64 of exactly that, and with the dequantize
  path (codes * scale rounded to the compute dtype, then the torch loop), which carries one more rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeserve.formats.int8 import dequantize_int8_per_channel, quantize_int8_per_channel
from moeserve.models.experts.unit_math import swiglu_expert
from tests.kernels.ops import lazy_ops

ops = lazy_ops()


def routing(n: int, e: int, k: int, gen: torch.Generator, repeat_expert: int | None = None):
    """(token_of, weight_of, spans per expert) as MoEBlock builds them: pairs grouped by expert, ascending."""
    if repeat_expert is not None:  # every token picks this expert (plus others)
        ids = torch.stack([torch.cat([torch.tensor([repeat_expert]),
                                      torch.tensor([j for j in torch.randperm(e, generator=gen).tolist()
                                                    if j != repeat_expert][: k - 1])]) for _ in range(n)])
    else:
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
    weights = torch.rand(n, k, generator=gen)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=e).tolist()
    spans, start = [], 0
    for c in counts:
        spans.append((start, start + c))
        start += c
    return order // k, weights.reshape(-1)[order].float(), spans


def loop_reference(out, x, units, token_of, weight_of, spans, kernel=swiglu_expert):
    """MoEBlock's torch loop (any dtype: float64 gives the exact math)."""
    out = out.clone()
    for w, (lo, hi) in zip(units, spans):
        if hi == lo:
            continue
        t = token_of[lo:hi]
        y = kernel(x[t], w) * weight_of[lo:hi, None].to(torch.float64 if x.dtype == torch.float64 else torch.float32)
        out[t] += y.to(out.dtype)
    return out


def make_units(e: int, h: int, i: int, dtype: torch.dtype, gen: torch.Generator):
    return [((torch.randn(2 * i, h, generator=gen) / h**0.5).to(dtype),
             (torch.randn(h, i, generator=gen) / i**0.5).to(dtype)) for _ in range(e)]


def spans_flat(spans) -> list[int]:
    return [b for s in spans for b in s]


SHAPES = [(64, 32, 1, 4, 2), (100, 37, 5, 3, 2), (33, 70, 9, 5, 3), (1024, 512, 1, 8, 4), (96, 48, 8, 32, 4),
          (17, 1, 3, 2, 1), (40, 24, 2, 6, 6)]


@pytest.mark.parametrize("h,i,n,e,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_op_matches_references(h, i, n, e, k, dtype):
    gen = torch.Generator().manual_seed(h * 1000 + i * 10 + n)
    units = make_units(e, h, i, dtype, gen)
    x = torch.randn(n, h, generator=gen).to(dtype)
    out0 = torch.randn(n, h, generator=gen).to(dtype)
    token_of, weight_of, spans = routing(n, e, k, gen)
    got = ops.moe_swiglu_(out0.clone(), x, [u[0] for u in units], [u[1] for u in units], token_of, weight_of,
                          spans_flat(spans))
    exact = loop_reference(out0.double(), x.double(), [(a.double(), b.double()) for a, b in units], token_of,
                           weight_of, spans)
    torch_loop = loop_reference(out0, x, units, token_of, weight_of, spans)
    err, torch_err = (got.double() - exact).abs().max().item(), (torch_loop.double() - exact).abs().max().item()
    if dtype == torch.bfloat16:
        # the same roundings as the torch loop: as close to exact (a dot product summed in another order can
        # round g/u/down one bf16 step the other way, which moves an output by a step or two)
        assert err <= 2 * torch_err + 1e-6, (err, torch_err)
        assert (got == torch_loop).float().mean() > 0.97
    else:
        scale = exact.abs().max().item()
        assert err <= 1e-5 * scale + 1e-6, (err, torch_err, scale)


def test_repeated_and_empty_experts_and_chunking():
    """An expert every token uses, experts with no token, and the experts split over several calls (chunks):
    the same bits as one call (bf16 adds expert after expert in ascending order)."""
    gen = torch.Generator().manual_seed(7)
    h, i, n, e, k = 72, 40, 6, 7, 3
    units = make_units(e, h, i, torch.bfloat16, gen)
    x = torch.randn(n, h, generator=gen).bfloat16()
    token_of, weight_of, spans = routing(n, e, k, gen, repeat_expert=2)
    assert spans[2][1] - spans[2][0] == n and any(hi == lo for lo, hi in spans)
    one = ops.moe_swiglu_(torch.zeros(n, h, dtype=torch.bfloat16), x, [u[0] for u in units],
                          [u[1] for u in units], token_of, weight_of, spans_flat(spans))
    chunked = torch.zeros(n, h, dtype=torch.bfloat16)
    for part in ([0, 1, 2], [3], [4, 5, 6]):
        ops.moe_swiglu_(chunked, x, [units[j][0] for j in part], [units[j][1] for j in part], token_of, weight_of,
                        spans_flat([spans[j] for j in part]))
    assert torch.equal(one, chunked)
    assert ops.moe_swiglu_(torch.ones(n, h, dtype=torch.bfloat16), x, [], [], token_of, weight_of, []).eq(1).all()


def test_result_independent_of_buffer_and_threads():
    """Weights copied to other (differently aligned) buffers, and 1 vs 2 threads: the same bits."""
    gen = torch.Generator().manual_seed(3)
    h, i, n, e, k = 130, 66, 4, 5, 2
    units = make_units(e, h, i, torch.bfloat16, gen)
    x = torch.randn(n, h, generator=gen).bfloat16()
    token_of, weight_of, spans = routing(n, e, k, gen)

    def moved(t: torch.Tensor, offset: int) -> torch.Tensor:
        raw = torch.empty(t.numel() + offset, dtype=t.dtype)
        view = raw[offset:].view(t.shape)
        view.copy_(t)
        return view

    def run(us) -> torch.Tensor:
        return ops.moe_swiglu_(torch.zeros(n, h, dtype=torch.bfloat16), x, [u[0] for u in us],
                               [u[1] for u in us], token_of, weight_of, spans_flat(spans))

    base = run(units)
    assert torch.equal(base, run([(moved(a, 3), moved(b, 17)) for a, b in units]))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = run(units)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(base, single)


@pytest.mark.parametrize("h,i,n,e,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_op(h, i, n, e, k, dtype):
    gen = torch.Generator().manual_seed(h + i + n)
    dense = make_units(e, h, i, torch.float32, gen)
    q = [(quantize_int8_per_channel(a), quantize_int8_per_channel(b)) for a, b in dense]
    x = torch.randn(n, h, generator=gen).to(dtype)
    out0 = torch.zeros(n, h, dtype=dtype)
    token_of, weight_of, spans = routing(n, e, k, gen)
    got = ops.moe_swiglu_int8_(out0.clone(), x, [a[0] for a, _ in q], [a[1] for a, _ in q], [b[0] for _, b in q],
                               [b[1] for _, b in q], token_of, weight_of, spans_flat(spans))
    exact_w = [(a[0].double() * a[1].double()[:, None], b[0].double() * b[1].double()[:, None]) for a, b in q]
    exact = loop_reference(out0.double(), x.double(), exact_w, token_of, weight_of, spans)

    def deq(codes, scale):
        buf = torch.empty(codes.shape, dtype=dtype)
        dequantize_int8_per_channel(codes, scale, buf)
        return buf

    dequant_path = loop_reference(out0, x, [(deq(*a), deq(*b)) for a, b in q], token_of, weight_of, spans)
    err = (got.double() - exact).abs().max().item()
    deq_err = (dequant_path.double() - exact).abs().max().item()
    scale = exact.abs().max().item()
    if dtype == torch.bfloat16:
        assert err <= 2 * deq_err + 1e-6, (err, deq_err)
    else:
        assert err <= 1e-5 * scale + 1e-6, (err, deq_err, scale)


def test_bad_arguments_raise():
    x = torch.zeros(2, 32, dtype=torch.bfloat16)
    gu, dn = torch.zeros(16, 32, dtype=torch.bfloat16), torch.zeros(32, 8, dtype=torch.bfloat16)
    tok, w = torch.tensor([0, 5]), torch.ones(2)
    with pytest.raises(RuntimeError, match="token index"):
        ops.moe_swiglu_(torch.zeros_like(x), x, [gu], [dn], tok, w, [0, 2])
    with pytest.raises(RuntimeError, match="gate_up"):
        ops.moe_swiglu_(torch.zeros_like(x), x, [gu.float()], [dn], torch.tensor([0, 1]), w, [0, 2])
    with pytest.raises(RuntimeError, match="bounds"):
        ops.moe_swiglu_(torch.zeros_like(x), x, [gu], [dn], torch.tensor([0, 1]), w, [0, 3])


def test_silu_gate_rows_first():
    """gate rows come first in gate_up: an expert whose up rows are zero outputs exactly zero."""
    gen = torch.Generator().manual_seed(1)
    gu = torch.randn(16, 32, generator=gen).bfloat16()
    gu[8:] = 0
    dn = torch.randn(32, 8, generator=gen).bfloat16()
    x = torch.randn(1, 32, generator=gen).bfloat16()
    got = ops.moe_swiglu_(torch.zeros_like(x), x, [gu], [dn], torch.tensor([0]), torch.ones(1), [0, 1])
    assert got.eq(0).all()
    g, u = F.linear(x, gu).chunk(2, -1)
    assert u.eq(0).all() and g.ne(0).any()


# ---------------------------------------------------------------------------------------- interleaved units
def interleaved_ops():  # noqa: ANN201 - torch.ops namespace
    if not bool(ops.moe_interleaved_supported()):
        pytest.skip("the kernels were built without AVX512-BF16 (no interleaved expert op)")
    return ops


def run_interleaved(out0, x, units, token_of, weight_of, spans):
    from moeserve.models.layers.linear import interleave_rows

    return interleaved_ops().moe_swiglu_interleaved_(out0.clone(), x, [interleave_rows(a) for a, _ in units],
                                                     [interleave_rows(b) for _, b in units], token_of, weight_of,
                                                     spans_flat(spans))


@pytest.mark.parametrize("h,i,n,e,k", [(64, 32, 1, 4, 2), (96, 64, 5, 6, 3), (1024, 512, 1, 8, 4),
                                       (128, 32, 9, 8, 2), (64, 96, 70, 16, 4), (32, 32, 130, 5, 5)])
def test_interleaved_op_matches_references(h, i, n, e, k):
    """Units in the row-interleaved layout, any token count (prefill too): as close to the float64 result as
    MoEBlock's torch loop on the plain units, and mostly the same bits as the plain-layout op."""
    gen = torch.Generator().manual_seed(h + 7 * i + n)
    units = make_units(e, h, i, torch.bfloat16, gen)
    x = torch.randn(n, h, generator=gen).bfloat16()
    out0 = torch.randn(n, h, generator=gen).bfloat16()
    token_of, weight_of, spans = routing(n, e, k, gen)
    got = run_interleaved(out0, x, units, token_of, weight_of, spans)
    exact = loop_reference(out0.double(), x.double(), [(a.double(), b.double()) for a, b in units], token_of,
                           weight_of, spans)
    torch_loop = loop_reference(out0, x, units, token_of, weight_of, spans)
    err, torch_err = (got.double() - exact).abs().max().item(), (torch_loop.double() - exact).abs().max().item()
    assert err <= 2 * torch_err + 1e-6, (err, torch_err)
    assert (got == torch_loop).float().mean() > 0.97


def test_interleaved_op_chunking_threads_and_empty_experts():
    """Experts split over calls, one thread vs two, experts without tokens: the same bits."""
    gen = torch.Generator().manual_seed(11)
    h, i, n, e, k = 96, 64, 12, 7, 3
    units = make_units(e, h, i, torch.bfloat16, gen)
    x = torch.randn(n, h, generator=gen).bfloat16()
    token_of, weight_of, spans = routing(n, e, k, gen, repeat_expert=4)
    zeros = torch.zeros(n, h, dtype=torch.bfloat16)
    one = run_interleaved(zeros, x, units, token_of, weight_of, spans)
    chunked = zeros.clone()
    for part in ([0, 1], [2, 3, 4], [5, 6]):
        chunked = run_interleaved(chunked, x, [units[j] for j in part], token_of, weight_of, [spans[j] for j in part])
    assert torch.equal(one, chunked)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = run_interleaved(zeros, x, units, token_of, weight_of, spans)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, single)


def test_interleaved_op_rejects_bad_shapes():
    iops = interleaved_ops()
    x = torch.zeros(1, 48, dtype=torch.bfloat16)  # H not a multiple of 32
    gu, dn = torch.zeros(64 * 48, dtype=torch.bfloat16), torch.zeros(48 * 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="multiples of 32"):
        iops.moe_swiglu_interleaved_(torch.zeros_like(x), x, [gu], [dn], torch.tensor([0]), torch.ones(1), [0, 1])
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"expected 2I\*H"):  # down has the wrong size for [H, I]
        iops.moe_swiglu_interleaved_(torch.zeros_like(x), x, [torch.zeros(64 * 64, dtype=torch.bfloat16)],
                                     [torch.zeros(64 * 16, dtype=torch.bfloat16)], torch.tensor([0]), torch.ones(1),
                                     [0, 1])


@pytest.mark.parametrize("h,i,n,e,k", [(64, 32, 1, 4, 2), (96, 64, 9, 6, 3), (1024, 512, 1, 8, 4),
                                       (64, 96, 70, 16, 4)])
def test_int8_interleaved_op(h, i, n, e, k):
    """int8 codes in pack_int8_rows' layout: as close to float64 of dot(codes, x) * scale as the dequantize path,
    and mostly the same bits as the plain-layout int8 op."""
    from moeserve.models.layers.linear import pack_int8_rows

    if not bool(ops.moe_int8_interleaved_supported()):
        pytest.skip("the kernels were built without AVX512-BF16/VBMI")
    gen = torch.Generator().manual_seed(5 * h + i + n)
    q = [(quantize_int8_per_channel(a), quantize_int8_per_channel(b)) for a, b in make_units(e, h, i, torch.float32,
                                                                                           gen)]
    x = torch.randn(n, h, generator=gen).bfloat16()
    out0 = torch.randn(n, h, generator=gen).bfloat16()
    token_of, weight_of, spans = routing(n, e, k, gen)
    got = ops.moe_swiglu_int8_interleaved_(out0.clone(), x, [pack_int8_rows(a[0]) for a, _ in q], [a[1] for a, _ in q],
                                           [pack_int8_rows(b[0]) for _, b in q], [b[1] for _, b in q], token_of,
                                           weight_of, spans_flat(spans))
    plain = ops.moe_swiglu_int8_(out0.clone(), x, [a[0] for a, _ in q], [a[1] for a, _ in q], [b[0] for _, b in q],
                                 [b[1] for _, b in q], token_of, weight_of, spans_flat(spans))
    exact_w = [(a[0].double() * a[1].double()[:, None], b[0].double() * b[1].double()[:, None]) for a, b in q]
    exact = loop_reference(out0.double(), x.double(), exact_w, token_of, weight_of, spans)
    err, plain_err = (got.double() - exact).abs().max().item(), (plain.double() - exact).abs().max().item()
    assert err <= 2 * plain_err + 1e-6, (err, plain_err)
    assert (got == plain).float().mean() > 0.97
