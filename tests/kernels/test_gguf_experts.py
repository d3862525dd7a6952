"""moe_q4_experts_ on GGUF experts as stored (fmt=gguf, csrc/gguf_codes.cpp): Q8_0, Q4_0, Q4_K, Q5_K, Q6_K and MXFP4
blocks decoded in registers, SwiGLU units of Qwen's layout (gate and up two stored weights, then down):

- the decoded weights are the bf16 cast of the gguf-* formats' dequantized values (themselves the `gguf` package's
  bits: tests/formats/test_gguf_quants.py), f16 subnormal and zero scales included;
- the op equals the plain torch reference of q4_cases.py (those weights, canonical dots, the op's roundings), bit for
  bit, for decode-sized batches (rows decoded in registers) and prefill-sized ones (through the row buffer): `all_cases`
  are among tests/kernels/test_q4_experts.py's cases, checked there on every ISA level; and it is close to the fp32
  computation on the dequantized weights;
- a token's result does not depend on the others;
- units whose ggml type changes across layers (a Q4_K_M file's ffn_down_exps) are read by their type index; an index
  outside the spec's list is refused;
- a GGUF's gpt-oss units (MXFP4 gate and up shards, biases, act=gptoss-split) among `all_cases`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeserve.bench.q4_units import ProjectionShape, assemble, dequantized
from moeserve.checkpoint.gguf.quants import dequantize
from moeserve.formats import create_format
from moeserve.formats.gguf import GGUF_FORMATS, LayerMixedGGUFFormat
from tests.kernels.ops import lazy_ops
from tests.kernels.q4_cases import ACTS, _routing, gguf_blocks, make_case, reference, run_op, unit_views
from tests.kernels.test_canonical_isa import assert_same_bits

ops = lazy_ops()

TYPES = ("q8_0", "q4_0", "q4_k", "q5_k", "q6_k", "mxfp4")


def all_cases() -> list[dict]:
    cases = []
    for i, t in enumerate(TYPES):
        for j, (h, isz, tokens, n_exp, edge) in enumerate(((256, 256, 1, 2, False), (512, 256, 3, 3, "small"),
                                                          (256, 512, 9, 2, False))):
            cases.append(make_case(f"gguf-{t}", "swiglu", h, isz, n_exp, tokens, 2, seed=100 * i + j, edge=edge))
    # a GGUF's gpt-oss: gate and up shards (gate rows, then up rows), biases, the clamped SwiGLU
    return [*cases, make_case("gguf-mxfp4", "gptoss-split", 128, 64, 3, 5, 2, seed=77, edge="small")]


@pytest.mark.parametrize("type_name", TYPES)
def test_decoded_weights_are_the_bf16_of_the_reference_values(type_name):
    for edge in (False, "small"):
        case = make_case(f"gguf-{type_name}", "swiglu", 256, 256, 1, 1, 2, seed=7, edge=edge)
        views = unit_views(case, 0)
        w1, _, w2, _ = case["dense"][0]
        for base, want, down in ((views[case["gate_up"]], w1, False), (views[case["down"]], w2, True)):
            assert_same_bits(ops.q4_decode(base, case["spec"], down), want, f"{type_name} edge={edge} down={down}")


@pytest.mark.parametrize("type_name", ("q8_0", "q4_k", "q6_k"))
def test_op_is_close_to_fp32_on_the_dequantized_weights(type_name):
    """The fp32 SwiGLU on the fp32 values of the gguf package's decoder: the op differs by its bf16 roundings only."""
    case = make_case(f"gguf-{type_name}", "swiglu", 512, 256, 2, 5, 2, seed=3)
    case["out"] = torch.zeros_like(case["out"])
    got = run_op(case, ops).float()
    want = torch.zeros(got.shape)
    for e, (lo, hi) in enumerate(case["bounds"]):
        views = unit_views(case, e)
        w = [dequantize(views[i], GGUF_FORMATS[type_name.upper()].ggml) for i in range(3)]
        toks = case["token_of"][lo:hi]
        x = case["x"][toks].float()
        a = F.silu(x @ w[0].T) * (x @ w[1].T)
        want[toks] += (a @ w[2].T) * case["weight_of"][lo:hi, None]
    err = (got - want).abs().max() / want.abs().max()
    assert err < 0.03, f"{type_name}: {err:.4f} of the largest output"


@pytest.mark.parametrize("type_name", ("q8_0", "q4_k", "q6_k"))
def test_a_tokens_result_does_not_depend_on_the_others(type_name):
    """11 tokens through every expert (the row-buffer path), against each token alone and in groups of 3 (the
    in-register path)."""
    case = make_case(f"gguf-{type_name}", "swiglu", 256, 256, 2, 11, 2, seed=21)
    case["token_of"] = torch.arange(11).repeat(2)
    case["weight_of"] = torch.rand(22)
    case["bounds"] = [(0, 11), (11, 22)]
    together = run_op(case, ops)
    for group_size in (1, 3):
        for t0 in range(0, 11, group_size):
            toks = list(range(t0, min(11, t0 + group_size)))
            n = len(toks)
            part = dict(case, x=case["x"][toks], out=case["out"][toks], token_of=torch.arange(n).repeat(2),
                        weight_of=torch.cat([case["weight_of"][toks], case["weight_of"][[11 + t for t in toks]]]),
                        bounds=[(0, n), (n, 2 * n)])
            assert_same_bits(run_op(part, ops), together[toks], f"{type_name}: tokens {toks} of 11")


def _mixed_case(seed: int) -> dict:
    """Units as a Q4_K_M file's: every weight a LayerMixedGGUFFormat of Q6_K and Q4_K (sized for Q6_K), expert e of
    type e % 2 (as if from two layers), with the field `type` the source writes."""
    gen = torch.Generator().manual_seed(seed)
    fmt = LayerMixedGGUFFormat((create_format("gguf-q4_k"), create_format("gguf-q6_k")))
    shapes = (ProjectionShape(512, 256, 2), ProjectionShape(256, 256, 1))
    stored_w, dense = [], []
    for e in range(3):
        weights = []
        for p in shapes:
            for _ in range(p.shards):
                blocks = gguf_blocks(("Q4_K", "Q6_K")[e % 2], p.rows // p.shards, p.cols, gen, False)
                padded = torch.zeros(blocks.shape[0], p.cols // 256 * 210, dtype=torch.uint8)  # Q6_K rows
                padded.view(-1)[: blocks.numel()] = blocks.view(-1)
                weights.append({"weight": padded, "type": torch.tensor([e % 2], dtype=torch.int32)})
        stored_w.append(weights)
        w1, w2 = dequantized(fmt, shapes, weights)
        dense.append((w1, None, w2, None))
    units = assemble(fmt, shapes, stored_w, [[None, None]] * 3, ACTS["swiglu"])
    return {**_routing(256, 5, 3, gen, False), "units": units.unit_bytes, "nbytes": units.layout.nbytes,
            "fields": [(f.dtype, f.shape, f.offset) for f in units.layout.fields], "gate_up": units.fused.gate_up,
            "down": units.fused.down, "spec": units.fused.spec, "dense": dense, "act": "swiglu"}


def test_units_whose_type_changes_across_layers_are_read_by_their_type_index():
    case = _mixed_case(seed=5)
    assert "gu.ggml=q4_k|q6_k@" in case["spec"] and "dn.ggml=q4_k|q6_k@" in case["spec"]
    assert_same_bits(run_op(case, ops), reference(case), "Q4_K / Q6_K units")
    type_field = next(i for i, (dt, _, _) in enumerate(case["fields"]) if dt == torch.int32)
    unit_views(case, 1)[type_field][0] = 2  # not an index into the two types
    with pytest.raises(RuntimeError, match="type index is 2"):
        run_op(case, ops)
