"""The canonical ops on aarch64, without ARM hardware: the numeric cores of the dense GEMV and the interleaved expert
op (csrc/dense_gemv_core.h, csrc/moe_interleaved.h) and of the 4-bit expert op's integer and GGUF dots (csrc/q4_q8.h:
int4 codes times int8-quantized activations; csrc/gguf_codes.cpp: Q8_0, Q4_0, Q4_K, Q5_K, Q6_K and MXFP4 blocks)
built as plain C++ (tests/kernels/harness/canonical_harness.cpp) for every x86 ISA level this CPU runs and, with
Debian's cross compiler, for aarch64 (NEON, NEON + BF16 + dot product, the scalar reference), run under qemu-aarch64
on the same inputs: the same bits everywhere, and the x86 harness the same bits as the torch ops and the 4-bit
references (tests/kernels/q8_reference.py, the GGUF decoder in torch, canonical_dots). Also: every csrc/*.cpp
compiles for aarch64 against torch's (architecture-independent) headers.

Needs g++-aarch64-linux-gnu and qemu-user (`make test-tools` installs them where apt-get is usable); without them
these tests skip, saying so. Outputs are compared as bits: -0 vs +0 and NaN payloads count.
"""

from __future__ import annotations

import math
import os
import platform
import shutil
import struct
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from moeserve import kernels
from moeserve.checkpoint.gguf.quants import TYPES_BY_NAME, dequantize
from tests.kernels.ops import suite_isa
from tests.kernels.q4_cases import _bf16_scales, gguf_blocks
from tests.kernels.q8_reference import q8_dots
from tests.kernels.test_canonical_isa import (
    assert_same_bits,
    canonical_dots,
    edge_values,
    expert_cases,
    interleave,
    linear_cases,
    one_thread,
    run_ops,
)

HARNESS = Path(__file__).with_name("harness") / "canonical_harness.cpp"
CSRC = kernels.CSRC
CROSS = "aarch64-linux-gnu-g++"
# aarch64 builds of the harness: (name, flags, the implementations it must report: bf16 dot, int4-q8 dot, GGUF decode;
# OpenMP threads). armv8.6-a has the dot product extension (SDOT) and, with +bf16, BFMLALT/BFMLALB: qemu's -cpu max
# has both; armv8-a neither (the plain NEON paths).
ARM_BUILDS = (
    ("neon", ("-march=armv8-a",), ("neon", "neon", "neon"), 2),
    ("neon-bf16", ("-march=armv8.6-a+bf16",), ("neon-bf16", "neon-dotprod", "neon"), 1),
    ("arm-scalar", ("-march=armv8-a", "-DMOESERVE_CANON_FORCE_SCALAR", "-DMOESERVE_Q8_FORCE_SCALAR"),
     ("scalar", "scalar", "scalar"), 1),
)
# native: whatever this CPU has; avx2 (x86-64-v3: no AVX-512, so no VNNI) and generic (x86-64: scalar) are forced
X86_IMPLEMENTATION = {"native": None, "avx2": ("avx2", "avx2", "scalar"), "generic": ("scalar", "scalar", "scalar")}
GGUF_TYPES = ("Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4")  # in moeserve_q4::GType's order


def _cross_tools() -> tuple[str, str]:
    """(cross compiler, qemu-aarch64), or a skip naming what is missing."""
    qemu = shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")
    missing = [name for name, found in ((CROSS, shutil.which(CROSS)), ("qemu-aarch64", qemu)) if not found]
    if missing:
        pytest.skip(f"no {' or '.join(missing)} on PATH (make test-tools installs g++-aarch64-linux-gnu and qemu-user)")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip(f"compares aarch64 under qemu with x86-64 builds: this host is {platform.machine()}")
    return CROSS, str(qemu)


def _compile(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stderr[-3000:]}"


def build_harness(cxx: str, flags: tuple[str, ...], out: Path, static: bool = False) -> Path:
    _compile([cxx, "-O3", *flags, "-std=c++20", "-fopenmp", *(["-static"] if static else []), f"-I{CSRC}",
              str(HARNESS), str(CSRC / "gguf_codes.cpp"), "-o", str(out)])
    return out


# ------------------------------------------------------------------------------------- the harness's files
def _u16(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.int16).numpy().tobytes()


def _i64(*values: int) -> bytes:
    return struct.pack(f"<{len(values)}q", *values)


def _linear_record(c: dict) -> bytes:
    (n, k), m = c["w"].shape, c["x"].shape[0]
    bias = c["bias"]
    head = _i64(0, m, n, k, int(bias is not None))
    return head + _u16(c["x"]) + _u16(interleave(c["w"])) + (bias.float().numpy().tobytes() if bias is not None else b"")


def _expert_record(c: dict) -> bytes:
    tokens, h = c["x"].shape
    isz = c["down"][0].shape[1]
    parts = [_i64(1, h, isz, tokens, len(c["gate_up"]), len(c["token_of"])), _u16(c["x"]), _u16(c["out"])]
    for gu, down in zip(c["gate_up"], c["down"]):
        parts += [_u16(interleave(gu)), _u16(interleave(down))]
    parts += [c["token_of"].numpy().astype("<i8").tobytes(), c["weight_of"].numpy().astype("<f4").tobytes(),
              _i64(*(b for lo_hi in c["bounds"] for b in lo_hi))]
    return b"".join(parts)


def _q8_record(c: dict) -> bytes:
    (m, k), n = c["x"].shape, c["codes"].shape[0]
    return _i64(3, m, n, k) + _u16(c["x"]) + c["codes"].numpy().tobytes() + _u16(c["scales"])


def _gguf_record(c: dict) -> bytes:
    (m, k), n = c["x"].shape, c["rows"].shape[0]
    return _i64(4, GGUF_TYPES.index(c["type"]), m, n, k) + _u16(c["x"]) + c["rows"].numpy().tobytes()


def write_inputs(path: Path, linear: list[dict], experts: list[dict], q8: list[dict], gguf: list[dict]) -> None:
    """The cases in the harness's input format (canonical_harness.cpp's header), the silu table record among them."""
    records = [_linear_record(c) for c in linear] + [_expert_record(c) for c in experts] + [_i64(2)] + \
        [_q8_record(c) for c in q8] + [_gguf_record(c) for c in gguf]
    path.write_bytes(b"MSHARN01" + _i64(len(records)) + b"".join(records))


def read_outputs(path: Path) -> tuple[tuple[str, ...], list[np.ndarray]]:
    """(the implementations the build ran: bf16 dot, int4-q8 dot, GGUF decode; one uint16 array per record)."""
    data = path.read_bytes()
    assert data[:8] == b"MSHARO01", f"{path}: not a harness output"
    (n,) = struct.unpack_from("<q", data, 8)
    isa, pos, outs = tuple(data[16:16 + n].decode().split()), 16 + n, []
    while pos < len(data):
        (count,) = struct.unpack_from("<q", data, pos)
        outs.append(np.frombuffer(data, dtype="<u2", count=count, offset=pos + 8))
        pos += 8 + 2 * count
    return isa, outs


def run_harness(cmd: list[str], inputs: Path, out: Path, threads: int) -> tuple[tuple[str, ...], list[np.ndarray]]:
    proc = subprocess.run([*cmd, str(inputs), str(out), str(threads)], capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, f"{' '.join(cmd)}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    return read_outputs(out)


def differing(got: list[np.ndarray], want: list[np.ndarray]) -> list[str]:
    """Per record whose bits differ: 'record i: d of n'."""
    assert len(got) == len(want)
    return [f"record {i}: {int((g != w).sum())} of {w.size}" for i, (g, w) in enumerate(zip(got, want))
            if g.shape != w.shape or (g != w).any()]


# ---------------------------------------------------------------------------------------------------- cases
def big_linear_case() -> dict:
    """An attention-projection-sized GEMV at real dimensions (hidden 2048), random values, 2 rows and a bias."""
    gen = torch.Generator().manual_seed(5)
    return {"w": (torch.randn(2048 + 4, 2048, generator=gen) * 2048**-0.5).bfloat16(),
            "x": torch.randn(2, 2048, generator=gen).bfloat16(), "bias": torch.randn(2052, generator=gen).bfloat16()}


def q8_cases() -> list[dict]:
    """INT4 rows times int8-quantized inputs (q4_q8.h): whole spans, and a padded one (k = 96) with edge scales and
    inputs: denormals, zeros, huge values, a block of zeros, one below 2^-100 (quantized to 0), inf and NaN."""
    gen = torch.Generator().manual_seed(31)
    cases = []
    for n, k, edge in ((8, 256, False), (4, 96, "small")):
        x = torch.randn(5, k, generator=gen)
        if edge:
            x[1] = edge_values((k,), gen, inf=False).float()
            x[2, :32], x[2, 32:64] = 0.0, x[2, 32:64] * 2.0**-110
            x[3, 5], x[3, 70] = math.inf, math.nan
        cases.append({"x": x.bfloat16(), "codes": torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8),
                      "scales": _bf16_scales((n, k // 32), gen, edge)})
    return cases


def gguf_cases() -> list[dict]:
    """Each GGUF type: 8 rows of 256 values (4 with typical scales, 4 with f16 subnormal and zero ones), 5 inputs (the
    last with denormals, zeros, huge values and infinities)."""
    gen = torch.Generator().manual_seed(32)
    cases = []
    for t in GGUF_TYPES:
        rows = torch.cat([gguf_blocks(t, 4, 256, gen, False), gguf_blocks(t, 4, 256, gen, "small")])
        x = torch.cat([torch.randn(4, 256, generator=gen).bfloat16(), edge_values((1, 256), gen, inf=True)])
        cases.append({"type": t, "rows": rows, "x": x})
    return cases


@pytest.fixture(scope="module")
def harness_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The inputs written once and the outputs on them of the x86 harness built for the suite's ISA level (native,
    or avx2 under `make test-as-avx2`): the bits every build must give."""
    tmp = tmp_path_factory.mktemp("aarch64")
    with one_thread():
        linear, experts = linear_cases() + [big_linear_case()], expert_cases()
    q8, gguf = q8_cases(), gguf_cases()
    inputs = tmp / "inputs.bin"
    write_inputs(inputs, linear, experts, q8, gguf)
    level = suite_isa()
    exe = build_harness("g++", kernels.ISA_FLAGS[level], tmp / f"harness-{level}")
    isa, outs = run_harness([str(exe)], inputs, tmp / f"{level}.out", threads=2)
    return {"tmp": tmp, "inputs": inputs, "linear": linear, "experts": experts, "q8": q8, "gguf": gguf, "isa": isa,
            "level": level, "want": outs,
            "boundary": len(linear) - 2}  # test_canonical_isa.boundary_rows: the last of linear_cases()


# ---------------------------------------------------------------------------------------------------- tests
@pytest.mark.slow
def test_x86_harness_equals_the_torch_ops(harness_run):
    """The harness runs the ops' own cores: its x86 build gives the bits of linear_interleaved and
    moe_swiglu_interleaved_ from the loaded library (the same ISA level) on every case."""
    from tests.kernels.ops import cpp_ops

    cpp_ops()
    got = run_ops(harness_run["linear"], harness_run["experts"])
    assert got["isa"] == [harness_run["isa"][0]]
    ops_out = [y.contiguous().view(torch.int16).numpy().view("<u2").reshape(-1) for y in got["linear"] + got["experts"]]
    assert differing(harness_run["want"][: len(ops_out)], ops_out) == []


def _canonical_nan(t: torch.Tensor) -> torch.Tensor:
    return torch.where(t.isnan(), torch.full_like(t, math.nan), t)  # the harness writes every NaN as the quiet one


def _dots_of(out: np.ndarray, m: int, n: int) -> torch.Tensor:
    """The dots section of an int4-q8 or GGUF record: [group size 1 .. 4, m, n] fp32."""
    return torch.from_numpy(out.copy().view("<f4")).reshape(4, m, n)


@pytest.mark.slow
def test_x86_harness_4bit_dots_equal_the_references(harness_run):
    """The 4-bit records of the suite level's harness: the int4-q8 dots, for every group size of inputs per call, are
    tests/kernels/q8_reference.py's; each GGUF row decodes to the bf16 cast of the torch decoder's values
    (moeserve/checkpoint/gguf/quants.py) and its dots are canonical_dots on those, bit for bit (a NaN as a NaN)."""
    q8, gguf = harness_run["q8"], harness_run["gguf"]
    outs = harness_run["want"][len(harness_run["want"]) - len(q8) - len(gguf):]
    for c, out in zip(q8, outs):
        (m, k), n = c["x"].shape, c["codes"].shape[0]
        want = _canonical_nan(q8_dots(c["codes"], c["scales"], c["x"]))
        dots = _dots_of(out[m * ((k + 63) // 64) * 96:], m, n)  # after the quantized rows (192 bytes per span)
        for mb in range(4):
            assert_same_bits(dots[mb], want, f"int4-q8 k={k}, {mb + 1} inputs per call")
    for c, out in zip(gguf, outs[len(q8):]):
        (m, k), n = c["x"].shape, c["rows"].shape[0]
        w = _canonical_nan(dequantize(c["rows"], TYPES_BY_NAME[c["type"]]).bfloat16())
        assert_same_bits(torch.from_numpy(out[: n * k].copy().view("<i2")).view(torch.bfloat16).reshape(n, k), w,
                         f"{c['type']} decoded")
        want = _canonical_nan(canonical_dots(w, c["x"]))
        for mb in range(4):
            assert_same_bits(_dots_of(out[n * k:], m, n)[mb], want, f"{c['type']}, {mb + 1} inputs per call")


@pytest.mark.slow
def test_every_x86_level_gives_the_same_bits(harness_run):
    """The harness built for the other x86 levels (avx2 where this CPU runs it): the suite level's bits."""
    for level in ("native", "avx2", "generic"):
        if level == harness_run["level"]:
            continue
        if level == "avx2" and kernels._unrunnable("avx2") is not None:
            continue
        exe = build_harness("g++", kernels.ISA_FLAGS[level], harness_run["tmp"] / f"harness-{level}")
        isa, outs = run_harness([str(exe)], harness_run["inputs"], harness_run["tmp"] / f"{level}.out", threads=1)
        assert isa == (X86_IMPLEMENTATION[level] or isa)
        assert differing(outs, harness_run["want"]) == [], f"x86 {level} vs {harness_run['level']}"


@pytest.mark.slow
def test_aarch64_under_qemu_gives_the_x86_bits(harness_run):
    """NEON (FMLA under FPCR.FZ, rows whose lanes flushed redone in scalar), NEON + BF16 (BFMLALT/BFMLALB) and the
    scalar reference, cross-compiled and run under qemu-aarch64: the x86 bits on every case, silu's libm
    expf included (all 65536 bf16 inputs)."""
    cxx, qemu = _cross_tools()
    for name, flags, implementation, threads in ARM_BUILDS:
        exe = build_harness(cxx, flags, harness_run["tmp"] / f"harness-{name}", static=True)
        isa, outs = run_harness([qemu, "-cpu", "max", str(exe)], harness_run["inputs"],
                                harness_run["tmp"] / f"{name}.out", threads)
        assert isa == implementation
        assert differing(outs, harness_run["want"]) == [], f"aarch64 {name} vs x86 {harness_run['level']}"


@pytest.mark.slow
def test_the_flush_check_is_needed(harness_run):
    """Negative control: NEON without the FPSR.UFC check (FPCR.FZ alone: flushing on the exact value, before
    rounding) differs from x86 on the case built around 2^-126 (test_canonical_isa.boundary_rows)."""
    cxx, qemu = _cross_tools()
    exe = build_harness(cxx, ("-march=armv8-a", "-DMOESERVE_CANON_TEST_IGNORE_UFC"),
                        harness_run["tmp"] / "harness-ignore-ufc", static=True)
    _, outs = run_harness([qemu, "-cpu", "max", str(exe)], harness_run["inputs"], harness_run["tmp"] / "ufc.out", 1)
    diff = differing(outs, harness_run["want"])
    assert any(d.startswith(f"record {harness_run['boundary']}:") for d in diff), diff


@pytest.mark.slow
def test_every_source_compiles_for_aarch64(tmp_path):
    """g++-aarch64-linux-gnu compiles every csrc/*.cpp (to an object, -O0: the code generator checks what
    -fsyntax-only does not, inline asm constraints among them, e.g. norm_common.h's) against the x86 wheel's torch
    headers, which hold no architecture-specific code. One precompiled header of ATen and torch/library.h serves
    every source; the sources compile in parallel on the CPUs this process may use. Cost (this 2-core EPYC, 18
    sources): 25 s of CPU for the header, 60 s for the sources (-fsyntax-only would be 36 s, missing the asm)."""
    cxx, _ = _cross_tools()
    t = Path(torch.__file__).parent
    common = ["-std=c++20", "-fopenmp", "-march=armv8-a", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
              f"-I{t / 'include'}", f"-I{t / 'include' / 'torch' / 'csrc' / 'api' / 'include'}"]
    pch = tmp_path / "torch_headers.h"
    pch.write_text("".join(f"#include <{h}>\n" for h in ("ATen/ATen.h", "ATen/Parallel.h", "torch/library.h",
                                                        "torch/custom_class.h")))

    def compile_one(cpp: Path) -> str | None:
        proc = subprocess.run([cxx, *common, "-O0", "-include", str(pch), "-c", str(cpp), "-o",
                               str(tmp_path / f"{cpp.stem}.o")], capture_output=True, text=True, timeout=900)
        return None if proc.returncode == 0 else f"{cpp.name}: {proc.stderr[-1500:]}"

    try:
        _compile([cxx, *common, "-O0", "-x", "c++-header", str(pch), "-o", f"{pch}.gch"])
        with ThreadPoolExecutor(max_workers=len(os.sched_getaffinity(0))) as pool:
            failed = [f for f in pool.map(compile_one, sorted(CSRC.glob("*.cpp"))) if f is not None]
        assert failed == [], "\n".join(failed)
    finally:
        Path(f"{pch}.gch").unlink(missing_ok=True)  # ~0.5 GB


def test_aarch64_isa_levels():
    """On aarch64, auto builds for the CPU (-mcpu=native), generic for armv8-a (NEON, every aarch64 CPU), avx2 is
    refused; x86 keeps its levels."""
    arm = kernels._isa_flags(x86=False, arm64=True)
    assert arm["native"] == ("-mcpu=native",) and arm["generic"] == ("-march=armv8-a",)
    x86 = kernels._isa_flags(x86=True, arm64=False)
    assert x86["native"] == ("-march=native",) and x86["generic"] == ("-march=x86-64", "-mtune=generic")
    assert x86["avx2"] == arm["avx2"] == ("-march=x86-64-v3", "-mtune=native")
