"""The canonical bf16 dot order (csrc/canonical_dot.h) gives the same bits on every ISA level the kernels build for
(native = AVX512-BF16 here, avx2, generic = scalar), and equals a plain torch reference of the stated order.

Each ISA level is its own library, and a process loads one (torch cannot unload one): the other levels run in
subprocesses (`python -m tests.kernels.test_canonical_isa <isa> <inputs> <outputs>`), on inputs saved by the test.
Those build only the sources that register the ops compared (kernels.build_subset: the same objects as the full
library of that level, minutes less of CI than every source for every level). Outputs are compared as bits (int16
views): -0 vs +0 and NaN payloads count.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from moeserve import kernels
from tests.kernels.ops import isa_subprocess_main, suite_isa

# ------------------------------------------------------------------------------------ the reference, plainly
TINY = 2.0**-126  # the smallest normal fp32


@contextmanager
def one_thread() -> Iterator[None]:
    """The reference's many small torch ops run 10x faster on one thread on a busy 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def bf16_from_float(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 as the kernels round (csrc/norm_common.h bf16_bits: nearest-even, every NaN -> 0x7FC0; torch's
    own conversion keeps a NaN's sign)."""
    u = v.float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    bits = torch.where(nan, torch.full_like(rounded, 0x7FC0), rounded & 0xFFFF)
    return bits.to(torch.int32).to(torch.int16).view(torch.bfloat16)


def daz(t: torch.Tensor) -> torch.Tensor:
    """bf16 -> fp64, a zero exponent (denormal) read as a zero of its sign (vdpbf16ps's DAZ)."""
    bits = t.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    bits = torch.where((bits & 0x7F80) == 0, bits & 0x8000, bits)
    return (bits << 16).to(torch.int32).view(torch.float32).double()


def fma_daz_ftz(a: torch.Tensor, b: torch.Tensor, acc: torch.Tensor, ftz_after_rounding: bool = True) -> torch.Tensor:
    """acc + a * b rounded once to fp32 (a * b exact in fp64: 8-bit significands; the fp64 sum then rounds to fp32
    correctly, 53 >= 2 * 24 + 2), a result tiny after rounding with an unbounded exponent flushed to a zero of its
    sign. ftz_after_rounding=False is the negative control: IEEE gradual underflow, then denormals flushed."""
    s = acc.double() + a * b
    r = s.float()
    tiny = s.abs() < TINY
    if not tiny.any():
        return r
    if not ftz_after_rounding:
        return torch.where(r.abs() < TINY, torch.copysign(torch.zeros_like(r), r), r)
    scaled = (s * 2.0**100).float()  # the unbounded-exponent rounding, moved into the normal range
    small = torch.where(scaled.abs() < 2.0**-26, 0.0, TINY)  # flushed, or rounded up to the smallest normal
    return torch.where(tiny, torch.copysign(small, s.float()), r)


def canonical_dots(w: torch.Tensor, x: torch.Tensor, ftz_after_rounding: bool = True) -> torch.Tensor:
    """[M, N] fp32 dots of x [M, K] with the rows of w [N, K] (bf16), in the canonical order: 16 lanes, lane i
    takes elements 2i + 1 then 2i of each 32-element chunk, chunks in order; then the halving sum."""
    m, k = x.shape
    n = w.shape[0]
    lanes = torch.zeros(m, n, 16, dtype=torch.float32)
    wd, xd = daz(w).reshape(n, k // 32, 16, 2), daz(x).reshape(m, k // 32, 16, 2)  # [..., chunk, lane, pair]
    for c in range(k // 32):
        for e in (1, 0):  # the odd element of each pair first, as VDPBF16PS's pseudo-code
            lanes = fma_daz_ftz(wd[None, :, c, :, e], xd[:, None, c, :, e], lanes, ftz_after_rounding)
    s8 = lanes[..., 8:] + lanes[..., :8]
    s4 = s8[..., 4:] + s8[..., :4]
    s2 = s4[..., :2] + s4[..., 2:]
    return s2[..., 0] + s2[..., 1]


def reference_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, **kw: bool) -> torch.Tensor:
    d = canonical_dots(w, x, **kw)
    return bf16_from_float(d + bias.float() if bias is not None else d)


def sequential_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The negative control: the same products summed one after another in fp32."""
    acc = torch.zeros(x.shape[0], w.shape[0])
    for j in range(x.shape[1]):
        acc = acc + x[:, j, None].float() * w[None, :, j].float()
    return bf16_from_float(acc + bias.float() if bias is not None else acc)


def _expf() -> ctypes._CFuncPtr:  # the libm expf the C++ silu calls (torch.exp may differ in the last bit)
    libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
    libm.expf.restype, libm.expf.argtypes = ctypes.c_float, [ctypes.c_float]
    return libm.expf


def reference_experts(case: dict, dots: Callable[[int, str, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """moe_swiglu_interleaved_ written plainly: canonical dots, then the op's bf16 roundings (csrc/moe_interleaved.h).
    `dots(expert, "gate_up" | "down", inputs)`: other fp32 dots (tests/kernels/test_canonical_int8.py: int8 units'
    scaled dots, zero-padded plain rows)."""
    dots = dots or (lambda e, which, xs: canonical_dots(case[which][e], xs))
    expf = _expf()
    x, out = case["x"], case["out"].clone()
    rnd = lambda v: bf16_from_float(v).float()  # noqa: E731
    for e, (lo, hi) in enumerate(case["bounds"]):
        if hi == lo:
            continue
        toks = case["token_of"][lo:hi]
        gu = rnd(dots(e, "gate_up", x[toks]))
        isz = gu.shape[1] // 2
        g, u = gu[:, :isz], gu[:, isz:]
        silu = g / (1.0 + torch.tensor([[expf(-v) for v in row.tolist()] for row in g], dtype=torch.float32))
        act = bf16_from_float(rnd(silu) * u)
        d = rnd(dots(e, "down", act))
        y = rnd(d * case["weight_of"][lo:hi, None])
        for t, tok in enumerate(toks.tolist()):  # expert after expert, token after token: each add rounded
            out[tok] = bf16_from_float(out[tok].float() + y[t])
    return out


# ------------------------------------------------------------------------------------------------ the inputs
def interleave(w: torch.Tensor) -> torch.Tensor:
    """The row-interleaved layout (csrc/dense_gemv.cpp): blocks of 4 rows with their 32-element chunks side by
    side, then the N % 4 leftover rows as they are."""
    n, k = w.shape
    b = n // 4
    blocks = w[: 4 * b].reshape(b, 4, k // 32, 32).permute(0, 2, 1, 3).reshape(-1)
    return torch.cat([blocks, w[4 * b :].reshape(-1)])


def edge_values(shape: tuple[int, ...], gen: torch.Generator, inf: bool) -> torch.Tensor:
    """Normal values with denormals, +-0, large magnitudes (products overflow) and, where asked, a few infinities."""
    v = torch.randn(shape, generator=gen)
    pick = torch.rand(shape, generator=gen)
    sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0)
    denormal = sign * torch.randint(1, 128, shape, generator=gen) * 2.0**-133
    large = sign * 2.0 ** torch.randint(60, 127, shape, generator=gen).float()
    v = torch.where(pick < 0.06, denormal, v)
    v = torch.where((pick >= 0.06) & (pick < 0.10), sign * 0.0, v)
    v = torch.where((pick >= 0.10) & (pick < 0.11), large, v)
    if inf:
        v = torch.where(pick > 0.998, sign * math.inf, v)
    return v.bfloat16()


def boundary_rows(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """w [n, 64], x [1, 64] whose lane n % 16 of row n ends just around 2^-126, where flushing after or before
    rounding differ: chunk 0 builds 2^-126 + j 2^-149 (j in -4..8), chunk 1 adds one tiny product."""
    x = torch.zeros(1, 64)
    w = torch.zeros(n, 64)
    lane = torch.arange(n) % 16
    j = torch.randint(-4, 9, (n,), generator=gen).float()
    x[0, 0:32:2], x[0, 1:32:2] = 2.0**-74, 2.0**-63  # even element, odd element of each lane in chunk 0
    x[0, 33:64:2] = (1 + torch.randint(0, 128, (16,), generator=gen) / 128) * 2.0**-76
    rows = torch.arange(n)
    w[rows, 2 * lane + 1] = 2.0**-63  # 2^-126 ...
    w[rows, 2 * lane] = j * 2.0**-75  # ... + j 2^-149
    tiny = (1 + torch.randint(0, 128, (n,), generator=gen) / 128) * 2.0 ** -torch.randint(72, 80, (n,), generator=gen)
    w[rows, 33 + 2 * lane] = torch.where(torch.rand(n, generator=gen) < 0.5, -tiny, tiny)
    return w.bfloat16(), x.bfloat16()


def cancelling_rows(n: int, m: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """w [n, k], x [m, k] whose second halves nearly cancel the first: partial sums far above the result, so the
    order of the additions shows in bf16 outputs (random rows hide it: their dots round alike to bf16)."""
    x = torch.randn(m, k // 2, generator=gen)
    w = torch.randn(n, k // 2, generator=gen)
    w_back = -w * (1 + torch.randn(n, k // 2, generator=gen) * 2.0**-10)
    return torch.cat([w, w_back], 1).bfloat16(), torch.cat([x, x], 1).bfloat16()


def linear_cases() -> list[dict]:
    gen = torch.Generator().manual_seed(7)
    cases = []
    for k in (32, 1024, 2880):
        for n in (8, 13, 67):  # N % 4 = 0, 1, 3
            for m in (1, 3, 17, 40):
                for with_bias in (False, True):
                    edge = (k + n + m) % 2 == 0  # half the cases random, half with edge values
                    w, x = (edge_values(s, gen, inf=k == 32) if edge else torch.randn(s, generator=gen).bfloat16()
                            for s in ((n, k), (m, k)))
                    b = torch.randn(n, generator=gen).bfloat16() if with_bias else None
                    cases.append({"w": w, "x": x, "bias": b})
    w, x = cancelling_rows(256 + 1, 4, 1024, gen)
    cases.append({"w": w, "x": x, "bias": None})  # [-2]: the order shows
    w, x = boundary_rows(4096 + 3, gen)
    cases.append({"w": w, "x": x, "bias": None})  # [-1]: the flush shows
    return cases


def expert_cases() -> list[dict]:
    gen = torch.Generator().manual_seed(11)
    cases = []
    for h, isz, tokens, n_exp in ((32, 32, 1, 2), (1024, 64, 3, 3), (2880, 96, 17, 4), (128, 32, 40, 3)):
        x = (torch.randn(tokens, h, generator=gen) * 0.5).bfloat16()
        gate_up = [(torch.randn(2 * isz, h, generator=gen) * h**-0.5).bfloat16() for _ in range(n_exp)]
        down = [(torch.randn(h, isz, generator=gen) * isz**-0.5).bfloat16() for _ in range(n_exp)]
        pairs = [(t, e) for t in range(tokens) for e in range(n_exp) if torch.rand(1, generator=gen) < 0.6]
        pairs.sort(key=lambda p: (p[1], p[0]))
        bounds, lo = [], 0
        for e in range(n_exp):
            hi = lo + sum(1 for p in pairs if p[1] == e)
            bounds.append((lo, hi))
            lo = hi
        cases.append({"x": x, "out": (torch.randn(tokens, h, generator=gen) * 0.1).bfloat16(), "gate_up": gate_up,
                      "down": down, "token_of": torch.tensor([p[0] for p in pairs], dtype=torch.long),
                      "weight_of": torch.rand(len(pairs), generator=gen), "bounds": bounds})
    return cases


# -------------------------------------------------------------------------------------- running one library
OPS = ("linear_interleaved", "moe_swiglu_interleaved_", "canonical_dot_isa")  # what run_ops calls


def sources_of(ops: tuple[str, ...]) -> tuple[str, ...]:
    """The csrc/*.cpp files that register these ops (`m.def("name(`): the subset library of the other ISA levels. A
    file that needs another's symbols fails to load there, loudly (the subprocess's error fails the test)."""
    texts = {f.name: f.read_text() for f in kernels.CSRC.glob("*.cpp")}
    found = {op: [name for name, text in texts.items() if re.search(rf'm\.def\("{re.escape(op)}\(', text)] for op in ops}
    missing = [op for op, files in found.items() if not files]
    assert not missing, f"no csrc/*.cpp registers {missing}"
    return tuple(sorted({name for files in found.values() for name in files}))


def run_ops(linear: list[dict], experts: list[dict]) -> dict[str, list[torch.Tensor]]:
    """The loaded library's outputs on the cases (in this process)."""
    ops = torch.ops.moeserve
    ys = [ops.linear_interleaved(c["x"], interleave(c["w"]), c["w"].shape[0], c["bias"]) for c in linear]
    outs = []
    for c in experts:
        out = c["out"].clone()
        ops.moe_swiglu_interleaved_(out, c["x"], [interleave(w) for w in c["gate_up"]],
                                    [interleave(w) for w in c["down"]], c["token_of"], c["weight_of"],
                                    [b for lo_hi in c["bounds"] for b in lo_hi])
        outs.append(out)
    return {"linear": ys, "experts": outs, "isa": [str(ops.canonical_dot_isa())]}


def run_isa_subprocess(isa: str, inputs: Path, outputs: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.test_canonical_isa", isa, str(inputs), str(outputs)],
                          capture_output=True, text=True, timeout=3600, cwd=Path(__file__).parents[2])
    if proc.returncode == 3:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stderr[-3000:]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    diff = bits(got) != bits(want)
    assert not diff.any(), f"{what}: {int(diff.sum())} of {diff.numel()} outputs differ"


# ---------------------------------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def cases() -> dict[str, list]:
    """The inputs and their reference outputs (computed once)."""
    with one_thread():
        linear, experts = linear_cases(), expert_cases()
        return {"linear": linear, "experts": experts,
                "linear_ref": [reference_linear(c["x"], c["w"], c["bias"]) for c in linear],
                "experts_ref": [reference_experts(c) for c in experts]}


def test_reference_can_fail(cases):
    """Negative controls: a sequential fp32 sum, and a flush of denormal results after IEEE rounding (instead of
    vdpbf16ps's flush of results tiny after rounding), both differ from the canonical reference."""
    case, want = cases["linear"][-2], cases["linear_ref"][-2]
    with one_thread():
        assert (bits(sequential_linear(case["x"], case["w"], case["bias"])) != bits(want)).any()
        boundary, want = cases["linear"][-1], cases["linear_ref"][-1]
        naive = reference_linear(boundary["x"], boundary["w"], None, ftz_after_rounding=False)
    assert (bits(naive) != bits(want)).any()


def test_loaded_library_equals_the_reference(cases):
    """This process's library (native) against the torch reference, every case."""
    from tests.kernels.ops import cpp_ops

    cpp_ops()
    got = run_ops(cases["linear"], cases["experts"])
    for i, (y, want) in enumerate(zip(got["linear"], cases["linear_ref"])):
        assert_same_bits(y, want, f"linear case {i}")
    for i, (out, want) in enumerate(zip(got["experts"], cases["experts_ref"])):
        assert_same_bits(out, want, f"expert case {i}")


@pytest.mark.slow
def test_every_isa_gives_the_same_bits(cases, tmp_path):
    """This process's library (native) and the avx2 and generic builds of the ops' sources (each built once, then
    cached) on the same inputs: the same bits, and those of the reference."""
    from tests.kernels.ops import cpp_ops

    cpp_ops()
    inputs = tmp_path / "inputs.pt"
    torch.save({"linear": cases["linear"], "experts": cases["experts"]}, inputs)
    results = {"native": run_ops(cases["linear"], cases["experts"])}
    for isa in ("avx2", "generic"):
        run_isa_subprocess(isa, inputs, tmp_path / f"{isa}.pt")
        results[isa] = torch.load(tmp_path / f"{isa}.pt")
    assert results["avx2"]["isa"] == ["avx2"] and results["generic"]["isa"] == ["scalar"]
    for isa, got in results.items():
        for i, (y, y_native) in enumerate(zip(got["linear"] + got["experts"], results["native"]["linear"]
                                               + results["native"]["experts"])):
            assert_same_bits(y, y_native, f"isa={isa} vs native, case {i}")
        for i, (y, want) in enumerate(zip(got["linear"], cases["linear_ref"])):
            assert_same_bits(y, want, f"isa={isa}, linear case {i}")
        for i, (out, want) in enumerate(zip(got["experts"], cases["experts_ref"])):
            assert_same_bits(out, want, f"isa={isa}, expert case {i}")


def test_one_isa_per_process():
    """A second ISA level in a process that loaded one is refused with the reason (torch cannot unload a library)."""
    status = kernels.load(suite_isa())
    if not status.available:
        pytest.skip(status.reason)
    assert f"built for isa={suite_isa()}" in status.reason
    other = kernels.load("generic")
    assert not other.available and "needs another process" in other.reason
    assert not kernels.load("sse9").available
    with pytest.raises(ValueError, match="unknown ISA level"):
        kernels.isa_level("sse9")
    assert kernels.isa_level("auto") == "native"
    assert kernels.flags("avx2") != kernels.flags("native")  # its own cache key


def _main(argv: list[str]) -> int:
    """Subprocess entry (tests/kernels/ops.py isa_subprocess_main): the linear and expert cases."""
    return isa_subprocess_main(argv, sources_of(OPS), lambda cases: run_ops(cases["linear"], cases["experts"]))


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
