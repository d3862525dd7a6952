"""moe_q4_experts_ on GGUF experts as stored (fmt=gguf, csrc/gguf_codes.cpp): Q8_0, Q4_0, Q4_K, Q5_K, Q6_K and MXFP4
blocks decoded in registers, SwiGLU units of Qwen's layout (gate and up two stored weights, then down):

- the decoded weights are the bf16 cast of the gguf-* formats' dequantized values (themselves the `gguf` package's
  bits: tests/formats/test_gguf_quants.py), f16 subnormal and zero scales included;
- the op equals the plain torch reference of q4_cases.py (those weights, canonical dots, the op's roundings), bit for
  bit, for decode-sized batches (rows decoded in registers) and prefill-sized ones (through the row buffer), and is
  close to the fp32 computation on the dequantized weights;
- a token's result does not depend on the others;
- units whose ggml type changes across layers (a Q4_K_M file's ffn_down_exps) are read by their type index; an index
  outside the spec's list is refused;
- native (AVX512-BF16 here), avx2 and generic (scalar) builds give the same bits (slow: subprocesses).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moeserve.bench.q4_units import ProjectionShape, assemble, dequantized
from moeserve.checkpoint.gguf.quants import dequantize
from moeserve.formats import create_format
from moeserve.formats.gguf import GGUF_FORMATS, LayerMixedGGUFFormat
from tests.kernels.ops import isa_subprocess_main, lazy_ops
from tests.kernels.q4_cases import ACTS, _routing, gguf_blocks, make_case, reference, run_op, unit_views
from tests.kernels.test_canonical_isa import assert_same_bits, one_thread

ops = lazy_ops()

TYPES = ("q8_0", "q4_0", "q4_k", "q5_k", "q6_k", "mxfp4")


def all_cases() -> list[dict]:
    cases = []
    for i, t in enumerate(TYPES):
        for j, (h, isz, tokens, n_exp, edge) in enumerate(((256, 256, 1, 2, False), (512, 256, 3, 3, "small"),
                                                          (256, 512, 9, 2, False))):
            cases.append(make_case(f"gguf-{t}", "swiglu", h, isz, n_exp, tokens, 2, seed=100 * i + j, edge=edge))
    return cases


@pytest.fixture(scope="module")
def cases() -> dict:
    with one_thread():
        built = all_cases()
        return {"cases": built, "refs": [reference(c) for c in built]}


def _run_all(built: list[dict]) -> dict:
    return {"experts": [run_op(c, ops) for c in built], "isa": [str(ops.canonical_dot_isa())]}


@pytest.mark.parametrize("type_name", TYPES)
def test_decoded_weights_are_the_bf16_of_the_reference_values(type_name):
    for edge in (False, "small"):
        case = make_case(f"gguf-{type_name}", "swiglu", 256, 256, 1, 1, 2, seed=7, edge=edge)
        views = unit_views(case, 0)
        w1, _, w2, _ = case["dense"][0]
        for base, want, down in ((views[case["gate_up"]], w1, False), (views[case["down"]], w2, True)):
            assert_same_bits(ops.q4_decode(base, case["spec"], down), want, f"{type_name} edge={edge} down={down}")


def test_op_equals_the_reference(cases):
    got = _run_all(cases["cases"])
    for i, (out, want) in enumerate(zip(got["experts"], cases["refs"])):
        assert_same_bits(out, want, f"case {i} ({cases['cases'][i]['spec'].split()[0]})")


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


# the sources of the compared ops: the expert op, its spec, the 4-bit and GGUF codes, and canonical_dot_isa
SOURCES = ("moe_experts_q4.cpp", "moe_experts_q4_spec.cpp", "q4_codes.cpp", "gguf_codes.cpp", "dense_gemv.cpp")


@pytest.mark.slow
def test_every_isa_gives_the_same_bits(cases, tmp_path):
    """This process's library (native here) and the avx2 and generic builds of the op's sources on the same inputs:
    the same bits, and those of the reference."""
    inputs = tmp_path / "inputs.pt"
    torch.save(cases["cases"], inputs)
    results = {"native": _run_all(cases["cases"])}
    for isa in ("avx2", "generic"):
        proc = subprocess.run([sys.executable, "-m", "tests.kernels.test_gguf_experts", isa, str(inputs),
                               str(tmp_path / f"{isa}.pt")], capture_output=True, text=True, timeout=3600,
                              cwd=Path(__file__).parents[2])
        if proc.returncode == 3:
            pytest.skip(proc.stdout.strip())
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[isa] = torch.load(tmp_path / f"{isa}.pt")
    assert results["avx2"]["isa"] == ["avx2"] and results["generic"]["isa"] == ["scalar"]
    for isa, got in results.items():
        for i, (out, want) in enumerate(zip(got["experts"], cases["refs"])):
            assert_same_bits(out, want, f"isa={isa}, case {i}")


def _main(argv: list[str]) -> int:
    """Subprocess entry (tests/kernels/ops.py isa_subprocess_main): the expert cases and the dot's ISA."""
    return isa_subprocess_main(argv, SOURCES, lambda cases: {
        "experts": [run_op(c, torch.ops.moeserve) for c in cases],
        "isa": [str(torch.ops.moeserve.canonical_dot_isa())]})


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
