"""The attention ops (decode_attention, mla_attention) compute the canonical order of csrc/attention_core.h: the same
bits on every ISA level the kernels build for (native = AVX-512 here, avx2, generic = scalar), and those of a plain
torch reference of the stated order (bf16 and fp32; the bf16 q.k dots are tests.kernels.test_canonical_isa's
canonical_dots).

Each ISA level is its own library and a process loads one, so the other levels run in subprocesses
(`python -m tests.kernels.test_attention_isa <isa> <inputs> <outputs>`) on inputs saved by the test, each loading a
library of only the attention sources (kernels.build_subset: the full library's objects). Outputs are compared as
bits. Negative controls: the reference with torch's exp (fp32: bf16 outputs round its last-bit
differences away), or with the q.k products summed one after another, differs from itself on the same inputs (so the
cases do show the order).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.kernels.ops import isa_subprocess_main
from tests.kernels.test_canonical_isa import (
    assert_same_bits,
    bf16_from_float,
    bits,
    canonical_dots,
    one_thread,
)

# The module is slow: its references (plain torch loops) take 5 s quiet, 15 s at load 15, in the first test's setup;
# tests/kernels/test_attention_ops.py checks the ops in the fast tier.
pytestmark = pytest.mark.slow

# The sources of the ops run_ops calls: the two that register them and the canonical core they share.
SOURCES = ("attention.cpp", "attention_core.cpp", "mla_attention.cpp")

# ------------------------------------------------------------------------------------- the reference, plainly
POLY = [torch.tensor(1.0) / k for k in (5040, 720, 120, 24, 6)] + [torch.tensor(v) for v in (0.5, 1.0, 1.0)]
LOG2E, LN2_HI, LN2_LO = (torch.tensor(v, dtype=torch.float32) for v in
                         (1.44269504088896341, 0.693145751953125, 1.428606765330187045e-06))


def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a * b + c rounded once to fp32 (the products here are exact in fp64; the fp64 sum of two fp32 values rounds
    to fp32 as a single rounding would: 53 >= 2 * 24 + 2)."""
    return (a.double() * b.double() + c.double()).float()


def exp_canon(x: torch.Tensor) -> torch.Tensor:
    """attention_core.h's exp: range reduction by ln 2 in two parts, Taylor to degree 7, times 2^n."""
    zero = x < -87
    xc = torch.where(x > -87, x, torch.tensor(-87.0))
    n = torch.round(xc * LOG2E)  # half to even
    r = fma(-n, LN2_HI, xc)
    r = fma(-n, LN2_LO, r)
    p = POLY[0].expand_as(r)
    for c in POLY[1:]:
        p = fma(p, r, c)
    return torch.where(zero, 0.0, torch.ldexp(p, n))


def halving_sum(lanes: torch.Tensor) -> torch.Tensor:
    s8 = lanes[..., 8:] + lanes[..., :8]
    s4 = s8[..., 4:] + s8[..., :4]
    s2 = s4[..., :2] + s4[..., 2:]
    return s2[..., 0] + s2[..., 1]


def pad32(t: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, -t.shape[-1] % 32))


def sequential_dots(keys: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Negative control: the products summed one after another in fp32."""
    acc = torch.zeros(q.shape[0], keys.shape[0])
    for i in range(q.shape[1]):
        acc = acc + q[:, i, None].float() * keys[None, :, i].float()
    return acc


def fp32_dots(keys: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """[H, L] fp32 dots in attention_core.h's fp32 order: 16 lanes from +0, lane i = fma(q[16c + i], k[16c + i],
    lane i) for the chunks c in order (zero-padded to 16), then the halving sum."""
    q16, k16 = (torch.nn.functional.pad(t.float(), (0, -t.shape[-1] % 16)) for t in (q, keys))
    lanes = torch.zeros(q.shape[0], keys.shape[0], 16)
    for c in range(0, q16.shape[1], 16):
        lanes = fma(q16[:, None, c : c + 16], k16[None, :, c : c + 16], lanes)
    return halving_sum(lanes)


def attend_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                     sinks: torch.Tensor | None, exp=exp_canon, dots=None) -> torch.Tensor:
    """One query row: q [H, dk] against keys [L, dk] and values [L, dv] (bf16 or fp32): [H, dv] in the stated
    order (dots: the q.k dots, by default the dtype's canonical ones)."""
    bf16 = q.dtype == torch.bfloat16
    if dots is None:
        s = canonical_dots(pad32(keys), pad32(q)) if bf16 else fp32_dots(keys, q)
    else:
        s = dots(keys, q)
    s = s * torch.tensor(scale)  # [H, L]
    m = s.max(dim=1).values
    if sinks is not None:
        m = torch.maximum(m, sinks)
    e = exp(s - m[:, None])
    lanes = torch.zeros(q.shape[0], 16)
    for c in range(0, e.shape[1], 16):
        lanes = lanes + torch.nn.functional.pad(e[:, c : c + 16], (0, 16 - e[:, c : c + 16].shape[1]))
    total = halving_sum(lanes)
    if sinks is not None:
        total = total + exp(sinks - m)
    p = bf16_from_float(e).float() if bf16 else e
    o = torch.zeros(q.shape[0], values.shape[1])
    for j in range(values.shape[0]):
        o = fma(p[:, j : j + 1], values[j].float()[None], o)
    o = o * (1.0 / total)[:, None]
    return bf16_from_float(o) if bf16 else o


def cache_rows(cache: torch.Tensor, table: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Positions [lo, hi) of one sequence from a paged cache [blocks, (heads,) bs, d] (heads kept first)."""
    bs = cache.shape[-2]
    rows = [cache[int(table[p // bs])][..., p % bs, :] for p in range(lo, hi)]
    return torch.stack(rows, dim=-2)


def reference_decode(c: dict, **kw) -> torch.Tensor:
    q, kc, vc, tables, seq, pos = c["q"], c["k"], c["v"], c["tables"], c["seq"], c["pos"]
    n, nh, d = q.shape
    nkv = kc.shape[1]
    group = nh // nkv
    out = torch.empty(n, nh, d, dtype=q.dtype)
    for i in range(n):
        hi = int(pos[i]) + 1
        lo = max(0, hi - c["window"]) if c["window"] else 0
        keys, values = cache_rows(kc, tables[seq[i]], lo, hi), cache_rows(vc, tables[seq[i]], lo, hi)
        for g in range(nkv):
            heads = slice(g * group, (g + 1) * group)
            sinks = None if c["sinks"] is None else c["sinks"][heads]
            out[i, heads] = attend_reference(q[i, heads], keys[g], values[g], c["scale"], sinks, **kw)
    return out.reshape(n, nh * d)


def row_dots(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """rows_dot of attention_core.h: [M, N] dots of x [M, K] with the rows of w [N, K] in the dtype's order, rounded
    once to the dtype."""
    if w.dtype == torch.bfloat16:
        return bf16_from_float(canonical_dots(pad32(w), pad32(x)))
    return fp32_dots(w, x)


def reference_mla(c: dict) -> torch.Tensor:
    q_nope, q_pe, cache, tables, seq, pos = c["q_nope"], c["q_pe"], c["cache"], c["tables"], c["seq"], c["pos"]
    w_uk_t, w_uv = c["w_uk_t"], c["w_uv"]
    n, nh, _ = q_nope.shape
    r = w_uk_t.shape[1]
    out = torch.empty(n, nh, w_uv.shape[1], dtype=q_nope.dtype)
    for i in range(n):
        rows = cache_rows(cache, tables[seq[i]], 0, int(pos[i]) + 1)  # [L, R + rope]
        q_lat = torch.cat([row_dots(w_uk_t[h], q_nope[i, h][None]) for h in range(nh)])  # [nh, R]
        o_lat = attend_reference(torch.cat([q_lat, q_pe[i]], dim=1), rows, rows[:, :r], c["scale"], None)  # [nh, R]
        for h in range(nh):
            out[i, h] = row_dots(w_uv[h], o_lat[h : h + 1])[0]
    return out


# ------------------------------------------------------------------------------------------------ the inputs
def values(shape: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Normal values with a few zeros of either sign and (bf16) denormals, which the dots read as zeros."""
    v = torch.randn(shape, generator=gen) * scale
    pick = torch.rand(shape, generator=gen)
    v = torch.where(pick < 0.02, torch.copysign(torch.full(shape, 3.0 * 2.0**-130), v), v)
    v = torch.where((pick >= 0.02) & (pick < 0.04), v * 0.0, v)
    return v.to(dtype)


def paged(gen: torch.Generator, seqs: int, max_len: int, bs: int, row_shape: tuple[int, ...],
          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache [blocks, *row_shape[:-1], bs, row_shape[-1]] of random rows in shuffled blocks, and the block
    tables [seqs, max_len / bs] that find each sequence's."""
    per = max_len // bs
    blocks = 2 * seqs * per
    cache = values((blocks, *row_shape[:-1], bs, row_shape[-1]), gen, dtype)
    return cache, torch.randperm(blocks, generator=gen)[: seqs * per].reshape(seqs, per)


def rows_of(gen: torch.Generator, seqs: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Query rows: a prefill run of 20 consecutive positions of sequence 0 (one tile), then rows of other
    sequences at random positions (decode), then position 0."""
    start = int(torch.randint(0, max_len - 20, (1,), generator=gen))
    seq = torch.cat([torch.zeros(20, dtype=torch.long), torch.randint(0, seqs, (6,), generator=gen),
                     torch.tensor([1])])
    pos = torch.cat([torch.arange(start, start + 20), torch.randint(0, max_len, (6,), generator=gen),
                     torch.tensor([0])])
    return seq, pos


def decode_cases() -> list[dict]:
    gen = torch.Generator().manual_seed(3)
    cases = []
    for dtype in (torch.bfloat16, torch.float32):
        for d, nh, nkv, window, sinks, max_len, bs in ((64, 8, 2, 0, False, 192, 16), (24, 6, 2, 0, True, 96, 8),
                                                       (128, 4, 1, 40, False, 128, 16), (80, 4, 4, 0, True, 64, 32)):
            k, tables = paged(gen, 3, max_len, bs, (nkv, d), dtype)
            v = values(k.shape, gen, dtype)
            seq, pos = rows_of(gen, 3, max_len)
            q = values((len(seq), nh, d), gen, dtype, 2.0)
            cases.append({"q": q, "k": k, "v": v, "tables": tables, "seq": seq, "pos": pos, "window": window,
                          "scale": d**-0.5, "sinks": torch.randn(nh, generator=gen) * 2 if sinks else None})
    return cases


def mla_cases() -> list[dict]:
    gen = torch.Generator().manual_seed(5)
    cases = []
    for dtype in (torch.bfloat16, torch.float32):
        for nh, nope, rope, r, v, max_len in ((4, 32, 16, 64, 32, 96), (3, 16, 8, 32, 12, 64)):
            cache, tables = paged(gen, 3, max_len, 16, (r + rope,), dtype)
            seq, pos = rows_of(gen, 3, max_len)
            cases.append({"q_nope": values((len(seq), nh, nope), gen, dtype), "q_pe": values((len(seq), nh, rope), gen,
                          dtype), "cache": cache, "tables": tables, "seq": seq, "pos": pos,
                          "w_uk_t": values((nh, r, nope), gen, dtype, nope**-0.5),
                          "w_uv": values((nh, v, r), gen, dtype, r**-0.5), "scale": (nope + rope) ** -0.5})
    return cases


# -------------------------------------------------------------------------------------- running one library
def run_ops(decode: list[dict], mla: list[dict]) -> dict[str, list[torch.Tensor]]:
    """The loaded library's outputs on the cases (in this process)."""
    ops = torch.ops.moeserve
    outs = [ops.decode_attention(c["q"], c["k"], c["v"], c["tables"], c["seq"], c["pos"], c["window"], c["scale"],
                                 c["sinks"]) for c in decode]
    outs_mla = [ops.mla_attention(c["q_nope"], c["q_pe"], c["cache"], c["tables"], c["seq"], c["pos"], c["w_uk_t"],
                                  c["w_uv"], c["scale"]) for c in mla]
    return {"decode": outs, "mla": outs_mla, "isa": [str(ops.attention_isa())]}


def run_isa_subprocess(isa: str, inputs: Path, outputs: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.test_attention_isa", isa, str(inputs), str(outputs)],
                          capture_output=True, text=True, timeout=3600, cwd=Path(__file__).parents[2])
    if proc.returncode == 3:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stderr[-3000:]


# ---------------------------------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def cases() -> dict[str, list]:
    with one_thread():
        decode, mla = decode_cases(), mla_cases()
        return {"decode": decode, "mla": mla,
                "decode_ref": [reference_decode(c) for c in decode], "mla_ref": [reference_mla(c) for c in mla]}


def test_reference_can_fail(cases):
    """Negative controls: torch's exp, or a sequential fp32 q.k sum, in place of the stated ones changes bits (on
    the cheapest fp32 case: bf16 outputs can round the exp's last-bit differences away)."""
    i = min((i for i, c in enumerate(cases["decode"]) if c["q"].dtype == torch.float32),
            key=lambda i: cases["decode"][i]["q"].numel())
    with one_thread():
        other_exp = reference_decode(cases["decode"][i], exp=torch.exp)
        other_dots = reference_decode(cases["decode"][i], dots=sequential_dots)
    assert (bits(other_exp) != bits(cases["decode_ref"][i])).any()
    assert (bits(other_dots) != bits(cases["decode_ref"][i])).any()


def test_loaded_library_equals_the_reference(cases):
    """This process's library (native) against the torch reference, every case (bf16, fp32), and the prefill rows of a
    call equal the same rows attended one by one."""
    from tests.kernels.ops import cpp_ops

    cpp_ops()
    got = run_ops(cases["decode"], cases["mla"])
    for i, (y, want) in enumerate(zip(got["decode"], cases["decode_ref"])):
        assert_same_bits(y, want, f"decode case {i}")
    for i, (y, want) in enumerate(zip(got["mla"], cases["mla_ref"])):
        assert_same_bits(y, want, f"mla case {i}")
    for c, whole in zip(cases["decode"], got["decode"]):
        for i in (0, 7, 19, 22):
            alone = run_ops([{**c, "q": c["q"][i : i + 1], "seq": c["seq"][i : i + 1], "pos": c["pos"][i : i + 1]}],
                            [])["decode"][0]
            assert torch.equal(bits(alone[0]), bits(whole[i]))


@pytest.mark.slow
def test_every_isa_gives_the_same_bits(cases, tmp_path):
    """This process's library (native) and the avx2 and generic builds of the attention sources (each built once,
    then cached) on the same inputs, bf16 and fp32: the same bits."""
    from tests.kernels.ops import cpp_ops

    cpp_ops()
    inputs = tmp_path / "inputs.pt"
    torch.save({"decode": cases["decode"], "mla": cases["mla"]}, inputs)
    results = {"native": run_ops(cases["decode"], cases["mla"])}
    for isa in ("avx2", "generic"):
        run_isa_subprocess(isa, inputs, tmp_path / f"{isa}.pt")
        results[isa] = torch.load(tmp_path / f"{isa}.pt")
    assert results["avx2"]["isa"] == ["avx2"] and results["generic"]["isa"] == ["scalar"]
    for isa, got in results.items():
        for kind in ("decode", "mla"):
            for i, (y, y_native) in enumerate(zip(got[kind], results["native"][kind])):
                assert_same_bits(y, y_native, f"isa={isa} vs native, {kind} case {i}")


def _main(argv: list[str]) -> int:
    """Subprocess entry (tests/kernels/ops.py isa_subprocess_main): the decode and MLA attention cases."""
    return isa_subprocess_main(argv, SOURCES, lambda cases: run_ops(cases["decode"], cases["mla"]))


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
