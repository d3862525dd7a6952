"""moe_q4_experts_ (csrc/moe_experts_q4.cpp): 4-bit expert units read as stored (MXFP4 in gpt-oss's and
compressed-tensors' layouts, NVFP4 in compressed-tensors' and ModelOpt's, compressed-tensors INT4 at two group sizes)
and gpt-oss's bf16 units, with SwiGLU, gpt-oss's clamped SwiGLU with biases and relu2:

- the decoded weights are the bits each format's reference decoder writes into bf16 (edge scales included: bf16
  subnormal and fp32-denormal products, overflow, every E8M0 byte);
- the op equals the plain torch reference of q4_cases.py (the reference decode, canonical dots, the op's roundings;
  int4-q8, quantization="int4"'s units: INT4 codes times int8-quantized activations, q8_reference.py's dots);
- a token's result does not depend on the others (alone, 4 at a time in registers, many through the row buffer);
- native (AVX512-BF16 here), avx2 and generic (scalar) builds give the same bits, on these cases and
  tests/kernels/test_gguf_experts.py's GGUF ones (the other levels in subprocesses,
  each loading a library of the op's sources only: `python -m tests.kernels.test_q4_experts <isa> <inputs> <outputs>`).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.kernels.ops import isa_subprocess_main, lazy_ops
from tests.kernels.q4_cases import make_bf16_case, make_case, reference, run_op, unit_views
from tests.kernels.test_canonical_isa import assert_same_bits, one_thread
from tests.kernels.test_gguf_experts import all_cases as gguf_cases

ops = lazy_ops()

# (format, activation, shards of gate_up, group)
KINDS = [("mxfp4-gpt-oss", "gptoss", 1, 32), ("mxfp4-ct", "swiglu", 2, 32), ("nvfp4-ct", "swiglu", 2, 16),
         ("nvfp4-modelopt", "relu2", 1, 16), ("int4-ct", "swiglu", 2, 32), ("int4-ct", "relu2", 1, 128),
         ("int4-q8", "swiglu", 2, 32), ("int4-q8", "gptoss", 1, 32)]  # int4-q8: quantization="int4"'s contract


def all_cases() -> list[dict]:
    cases = []
    for i, (fmt, act, shards, group) in enumerate(KINDS):
        for j, (h, isz, tokens, n_exp, edge) in enumerate(((128, 128, 1, 2, False), (1024, 128, 3, 3, "small"),
                                                          (256, 256, 9, 2, False))):
            cases.append(make_case(fmt, act, h, isz, n_exp, tokens, shards, seed=100 * i + j, edge=edge, group=group))
    cases.append(make_bf16_case(128, 32, 3, 6, seed=7))
    cases.append(make_bf16_case(1024, 64, 2, 3, seed=8, edge="small"))
    cases.append(make_case("mxfp4-gpt-oss", "gptoss", 2880, 64, 2, 2, 1, seed=9))  # gpt-oss's hidden size
    cases.append(make_case("int4-q8", "swiglu", 160, 96, 2, 5, 2, seed=10))  # K % 64 == 32: a padded block
    return cases + gguf_cases()  # GGUF blocks (tests/kernels/test_gguf_experts.py)


@pytest.fixture(scope="module")
def cases() -> dict:
    with one_thread():
        built = all_cases()
        return {"cases": built, "refs": [reference(c) for c in built]}


def _run_all(built: list[dict]) -> dict:
    return {"experts": [run_op(c, ops) for c in built], "isa": [str(ops.canonical_dot_isa())]}


def test_decoded_weights_are_the_reference_decoders_bits():
    """q4_decode (the op's row decoder) against formats/' dequantize into bf16, every format, edge scales."""
    for i, (fmt, act, shards, group) in enumerate(KINDS):
        for edge in (False, "small", "all"):
            case = make_case(fmt, act, 128, 128, 1, 1, shards, seed=1000 + i, edge=edge, group=group)
            views = unit_views(case, 0)
            w1, _, w2, _ = case["dense"][0]
            for base, want, down in ((views[case["gate_up"]], w1, False), (views[case["down"]], w2, True)):
                got = ops.q4_decode(base, case["spec"], down)
                assert_same_bits(got, want, f"{fmt} edge={edge} {'down' if down else 'gate_up'}")


def test_op_equals_the_reference(cases):
    got = _run_all(cases["cases"])
    for i, (out, want) in enumerate(zip(got["experts"], cases["refs"])):
        assert_same_bits(out, want, f"case {i} ({cases['cases'][i]['spec'].split()[0]})")


@pytest.mark.parametrize("kind", [0, 2, 4, 6, "bf16"])
def test_a_tokens_result_does_not_depend_on_the_others(kind):
    """11 tokens through every expert (the row-buffer path), against each token alone and in groups of 3 (the
    in-register path)."""
    if kind == "bf16":
        case = make_bf16_case(256, 64, 2, 11, seed=21)
    else:
        fmt, act, shards, group = KINDS[kind]
        case = make_case(fmt, act, 256, 128, 2, 11, shards, seed=21, group=group)
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
            assert_same_bits(run_op(part, ops), together[toks], f"tokens {toks} of 11")


def test_units_too_small_for_the_spec_are_refused():
    """The op reads a projection's other fields at the spec's offsets from its first tensor: a tensor whose storage
    ends before them is refused, never read past."""
    case = make_case("mxfp4-ct", "swiglu", 128, 128, 1, 1, 2, seed=5)
    views = unit_views(case, 0)
    alone = views[case["gate_up"]].clone()  # its own storage: the first field's bytes only
    with pytest.raises(RuntimeError, match="reaches"):
        ops.moe_q4_experts_(case["out"].clone(), case["x"], [alone], [views[case["down"]]], case["token_of"],
                            case["weight_of"], [b for lo_hi in case["bounds"] for b in lo_hi], case["spec"])


# the sources of the compared ops: the 4-bit op, its spec, its 4-bit and GGUF codes, and canonical_dot_isa
# (dense_gemv.cpp)
SOURCES = ("moe_experts_q4.cpp", "moe_experts_q4_spec.cpp", "q4_codes.cpp", "gguf_codes.cpp", "dense_gemv.cpp")


@pytest.mark.slow
def test_every_isa_gives_the_same_bits(cases, tmp_path):
    """This process's library (native here) and the avx2 and generic builds of the op's sources (kernels.build_subset,
    cached after the first build) on the same inputs: the same bits, and those of the reference."""
    inputs = tmp_path / "inputs.pt"
    torch.save(cases["cases"], inputs)
    results = {"native": _run_all(cases["cases"])}
    for isa in ("avx2", "generic"):
        proc = subprocess.run([sys.executable, "-m", "tests.kernels.test_q4_experts", isa, str(inputs),
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
