"""The int8 ops and the plain-layout expert op on the canonical order (csrc/canonical_int8.h, csrc/canonical_dot.h):
the same bits on every ISA level the kernels build for (native, avx2, generic = scalar), and equal to a plain torch
reference of the stated order.

- linear_interleaved_int8: each output the canonical dot of the row's code values (exact in bf16) with the input
  row, then fma(dot, scale, bias) in fp32 (one rounding; dot * scale without a bias), one rounding to bf16.
- moe_swiglu_int8_interleaved_ and moe_swiglu_int8_ (int8 units, interleaved and plain): each dot times the row's
  scale in fp32, then the bf16 roundings of moe_swiglu_interleaved_ (tests/kernels/test_canonical_isa.py's
  reference_experts): the same bits as a bf16 op on the code values with the scales applied after the dot.
- moe_swiglu_ with bf16 units (the plain layout): the same bits as the interleaved op on the same values; a row
  whose length is not a multiple of 32 is zero-padded to whole chunks.

Other ISA levels run in subprocesses, as in test_canonical_isa.py (one library per process). Outputs are compared
as bits (int16 views).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from moeserve.models.layers.linear import pack_int8_rows
from tests.kernels.ops import isa_subprocess_main
from tests.kernels.test_canonical_isa import (
    assert_same_bits,
    bf16_from_float,
    bits,
    cancelling_rows,
    canonical_dots,
    edge_values,
    one_thread,
    reference_experts,
    sources_of,
)

Dots = Callable[[int, str, torch.Tensor], torch.Tensor]  # (expert, "gate_up" | "down", inputs) -> fp32 dots


def _fmaf() -> Callable[[float, float, float], float]:  # fp32 fma, one rounding (libm)
    libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
    libm.fmaf.restype, libm.fmaf.argtypes = ctypes.c_float, [ctypes.c_float] * 3
    return libm.fmaf


def times_scale(d: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """dot * scale rounded once to fp32 (the product exact in fp64)."""
    return (d.double() * scale.double()).float()


# ------------------------------------------------------------------------------------------ the references
def reference_linear_int8(c: dict) -> torch.Tensor:
    d = canonical_dots(c["codes"].bfloat16(), c["x"])
    if c["bias"] is None:
        return bf16_from_float(times_scale(d, c["scale"]))
    fmaf, s, b = _fmaf(), c["scale"].tolist(), c["bias"].float().tolist()
    y = torch.tensor([[fmaf(v, s[j], b[j]) for j, v in enumerate(row)] for row in d.tolist()], dtype=torch.float32)
    return bf16_from_float(y)


def scaled_dots(case: dict) -> Dots:
    """The int8 expert ops' dots: the codes' values in the canonical order, then times the row's scale."""
    return lambda e, which, xs: times_scale(canonical_dots(case[which][e].bfloat16(), xs), case[f"{which}_scale"][e])


def padded_dots(case: dict) -> Dots:
    """The plain bf16 op's dots: rows and inputs zero-padded to whole chunks."""
    def dots(e: int, which: str, xs: torch.Tensor) -> torch.Tensor:
        w = case[which][e]
        pad = -w.shape[1] % 32
        return canonical_dots(torch.nn.functional.pad(w, (0, pad)), torch.nn.functional.pad(xs, (0, pad)))
    return dots


# ------------------------------------------------------------------------------------------------ the inputs
def edge_codes(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random codes in [-127, 127] with zeros and both extremes."""
    q = torch.randint(-127, 128, shape, generator=gen)
    pick = torch.rand(shape, generator=gen)
    q = torch.where(pick < 0.05, 0, torch.where(pick < 0.08, 127, torch.where(pick < 0.11, -127, q)))
    return q.to(torch.int8)


def linear_cases() -> list[dict]:
    gen = torch.Generator().manual_seed(17)
    cases = []
    for k, n, m in ((32, 13, 5), (64, 8, 1), (2048, 67, 3), (2880, 9, 17), (4096, 14, 2), (256, 6, 40)):
        for with_bias in (False, True):
            edge = (k // 32 + m) % 2 == 0  # half the cases random activations, half with edge values
            x = edge_values((m, k), gen, inf=False) if edge else torch.randn(m, k, generator=gen).bfloat16()
            cases.append({"codes": edge_codes((n, k), gen), "x": x,
                          "scale": torch.rand(n, generator=gen) * 2.0**-7 + 2.0**-12,
                          "bias": torch.randn(n, generator=gen).bfloat16() if with_bias else None})
    return cases


def _routing(tokens: int, n_exp: int, gen: torch.Generator) -> dict:
    pairs = sorted(((t, e) for t in range(tokens) for e in range(n_exp) if torch.rand(1, generator=gen) < 0.6),
                   key=lambda p: (p[1], p[0]))
    bounds, lo = [], 0
    for e in range(n_exp):
        hi = lo + sum(1 for p in pairs if p[1] == e)
        bounds.append((lo, hi))
        lo = hi
    return {"token_of": torch.tensor([p[0] for p in pairs], dtype=torch.long),
            "weight_of": torch.rand(len(pairs), generator=gen), "bounds": bounds}


def expert_cases(int8: bool) -> list[dict]:
    """int8: codes and scales (both layouts run them); bf16: plain units, H or I not always a multiple of 32."""
    gen = torch.Generator().manual_seed(23 if int8 else 29)
    shapes = ((32, 32, 1, 2), (2048, 64, 3, 3), (128, 32, 9, 3)) if int8 else \
        ((32, 32, 1, 2), (2880, 64, 5, 3), (48, 40, 6, 2), (128, 32, 9, 3))
    cases = []
    for h, isz, tokens, n_exp in shapes:
        c = {"x": (torch.randn(tokens, h, generator=gen) * 0.5).bfloat16(),
             "out": (torch.randn(tokens, h, generator=gen) * 0.1).bfloat16(), **_routing(tokens, n_exp, gen)}
        if int8:
            c["gate_up"] = [edge_codes((2 * isz, h), gen) for _ in range(n_exp)]
            c["down"] = [edge_codes((h, isz), gen) for _ in range(n_exp)]
            c["gate_up_scale"] = [torch.rand(2 * isz, generator=gen) * h**-0.5 / 64 for _ in range(n_exp)]
            c["down_scale"] = [torch.rand(h, generator=gen) * isz**-0.5 / 64 for _ in range(n_exp)]
        elif h == 2880:  # gate_up rows whose halves nearly cancel: the order of the additions shows in g and u
            half = torch.randn(tokens, h // 2, generator=gen) * 0.5
            c["x"] = torch.cat([half, half], 1).bfloat16()
            c["gate_up"] = [cancelling_rows(2 * isz, 1, h, gen)[0] for _ in range(n_exp)]
        else:
            c["gate_up"] = [(torch.randn(2 * isz, h, generator=gen) * h**-0.5).bfloat16() for _ in range(n_exp)]
        if not int8:
            c["down"] = [(torch.randn(h, isz, generator=gen) * isz**-0.5).bfloat16() for _ in range(n_exp)]
        cases.append(c)
    return cases


# -------------------------------------------------------------------------------------- running one library
OPS = ("linear_interleaved_int8", "moe_swiglu_int8_interleaved_", "moe_swiglu_int8_", "moe_swiglu_",
       "canonical_int8_isa")


def _bounds(c: dict) -> list[int]:
    return [b for lo_hi in c["bounds"] for b in lo_hi]


def run_ops(cases: dict) -> dict[str, list]:
    """The loaded library's outputs on the cases (in this process)."""
    ops = torch.ops.moeserve
    got: dict[str, list] = {"linear": [ops.linear_interleaved_int8(c["x"], pack_int8_rows(c["codes"]), c["scale"],
                                                                   c["codes"].shape[0], c["bias"])
                                       for c in cases["linear"]]}
    got["int8_interleaved"], got["int8_plain"], got["plain"] = [], [], []
    for c in cases["int8"]:
        routing = (c["token_of"], c["weight_of"], _bounds(c))
        out = c["out"].clone()
        ops.moe_swiglu_int8_interleaved_(out, c["x"], [pack_int8_rows(w) for w in c["gate_up"]], c["gate_up_scale"],
                                         [pack_int8_rows(w) for w in c["down"]], c["down_scale"], *routing)
        got["int8_interleaved"].append(out)
        out = c["out"].clone()
        ops.moe_swiglu_int8_(out, c["x"], c["gate_up"], c["gate_up_scale"], c["down"], c["down_scale"], *routing)
        got["int8_plain"].append(out)
    for c in cases["plain"]:
        out = c["out"].clone()
        ops.moe_swiglu_(out, c["x"], c["gate_up"], c["down"], c["token_of"], c["weight_of"], _bounds(c))
        got["plain"].append(out)
    got["isa"] = [str(ops.canonical_int8_isa())]
    return got


def run_isa_subprocess(isa: str, inputs: Path, outputs: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.test_canonical_int8", isa, str(inputs), str(outputs)],
                          capture_output=True, text=True, timeout=3600, cwd=Path(__file__).parents[2])
    if proc.returncode == 3:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stderr[-3000:]


def check_against_reference(got: dict, cases: dict, what: str) -> None:
    for key in ("linear", "int8_interleaved", "int8_plain", "plain"):
        ref = cases["linear_ref"] if key == "linear" else cases["plain_ref" if key == "plain" else "int8_ref"]
        for i, (y, want) in enumerate(zip(got[key], ref, strict=True)):
            assert_same_bits(y, want, f"{what}: {key} case {i}")


# ---------------------------------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def cases() -> dict[str, list]:
    """The inputs and their reference outputs (computed once)."""
    with one_thread():
        linear, int8, plain = linear_cases(), expert_cases(True), expert_cases(False)
        return {"linear": linear, "int8": int8, "plain": plain,
                "linear_ref": [reference_linear_int8(c) for c in linear],
                "int8_ref": [reference_experts(c, scaled_dots(c)) for c in int8],
                "plain_ref": [reference_experts(c, padded_dots(c)) for c in plain]}


def test_reference_can_fail(cases):
    """Negative controls: the scale applied to the codes before the dot (Int8Kernel's bf16 weights), and the expert
    op's dots summed one product after another in fp32, both differ from the references."""
    with one_thread():
        c = next(c for c in cases["linear"] if c["bias"] is None and c["codes"].shape[1] >= 2048)
        w = bf16_from_float(c["codes"].float() * c["scale"][:, None])
        assert (bits(bf16_from_float(canonical_dots(w, c["x"]))) != bits(reference_linear_int8(c))).any()
        p = cases["plain"][1]  # H = 2880, cancelling gate_up rows
        sequential = reference_experts(p, lambda e, which, xs: xs.float() @ p[which][e].float().T)
        assert (bits(sequential) != bits(cases["plain_ref"][1])).any()


def test_loaded_library_equals_the_reference(cases):
    """This process's library (native) against the torch references, every case."""
    from tests.kernels.ops import cpp_ops

    cpp_ops()
    check_against_reference(run_ops(cases), cases, "native")


@pytest.mark.slow
def test_every_isa_gives_the_same_bits(cases, tmp_path):
    """The avx2 and generic builds of the ops' sources (each built once, then cached) on the same inputs: the bits
    of the references, so those of the native library (test_loaded_library_equals_the_reference)."""
    inputs = tmp_path / "inputs.pt"
    torch.save({k: cases[k] for k in ("linear", "int8", "plain")}, inputs)
    for isa, implementation in (("avx2", "avx2"), ("generic", "scalar")):
        run_isa_subprocess(isa, inputs, tmp_path / f"{isa}.pt")
        got = torch.load(tmp_path / f"{isa}.pt")
        assert got["isa"] == [implementation]
        check_against_reference(got, cases, f"isa={isa}")


def _main(argv: list[str]) -> int:
    """Subprocess entry (tests/kernels/ops.py isa_subprocess_main)."""
    return isa_subprocess_main(argv, sources_of(OPS), run_ops)


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
