"""Streaming speed of the canonical-order kernels (bf16 and int8) on one ISA level, against torch and a stream-read
ceiling.

    ATEN_CPU_CAPABILITY=avx2 .venv/bin/python research/bench_canonical_gemv.py --isa avx2 [--rounds 5] [--threads 2]
        [--only stream,lm_head,lm_head int8]

--isa picks the library (native, avx2, generic: moeserve.kernels ISA levels; one per process);
ATEN_CPU_CAPABILITY=avx2 keeps torch's own kernels to AVX2 too (torch reads it at import), so that with oneDNN off
the torch cases run what an AVX2-only CPU's torch runs. Each round runs
every case once, in this order, so a busy machine slows them alike (report the ranges over rounds):
- stream: torch.sum over a 1 GiB fp32 buffer (a streaming read: the practical ceiling);
- gemv: `linear_interleaved`, one input row, over 16 matrices [4096 x 2048] (256 MiB: past the caches);
- gemv F.linear: torch's bf16 F.linear on the same plain matrices with oneDNN disabled (what torch does on a CPU
  without AVX512-BF16: torch.backends.mkldnn.enabled=False); "x16": with 16 input rows, the block of rows the
  engine pads a decode step to under batch_invariant (the rate still counts the weight bytes once);
- lm_head, lm_head F.linear (x16): the same on one [151936 x 2048] matrix (a Qwen-sized LM head, 594 MiB);
- experts: `moe_swiglu_interleaved_`, one token, 4 experts [2I=1536 x H=2048] + [2048 x 768] per call, over 64
  experts (576 MiB); experts plain: `moe_swiglu_` on the plain layout (the op AVX2 CPUs ran before);
- gemv int8, lm_head int8, experts int8, experts int8 plain: the same shapes as int8 codes (half the bytes; scales
  not counted): `linear_interleaved_int8`, `moe_swiglu_int8_interleaved_`, `moe_swiglu_int8_`.
--only runs the named cases (the stream ceiling always); --subset builds only the sources of these ops. To compare two trees (a branch against main), run the
script alternately with PYTHONPATH at each (each loads its own tree's kernels).
Prints GB/s (of the weight bytes each case reads) per round, then min-median-max.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from moeserve import kernels
from moeserve.models.layers.linear import pack_int8_rows

K = 2048  # hidden size of every case
N_SMALL, N_MATS, N_HEAD = 4096, 16, 151936
INTER, EXPERTS, PER_CALL = 768, 64, 4


def interleave(w: torch.Tensor) -> torch.Tensor:
    """The row-interleaved layout of csrc/dense_gemv.cpp (N % 4 == 0 here)."""
    n, k = w.shape
    return w.reshape(n // 4, 4, k // 32, 32).permute(0, 2, 1, 3).reshape(-1).contiguous()


def _codes(n: int, k: int = K, packed: bool = True) -> torch.Tensor:
    """Random int8 codes [n, k] in [-127, 127], in linear_interleaved_int8's layout (packed) or plain."""
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    return pack_int8_rows(q) if packed else q


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def dense_cases() -> dict[str, tuple[Callable[[], object], int]]:
    """name -> (one run, weight bytes it reads)."""
    ops = torch.ops.moeserve
    mats = [torch.randn(N_SMALL, K).bfloat16() for _ in range(N_MATS)]
    packed = [interleave(w) for w in mats]
    head = torch.randn(N_HEAD, K).bfloat16()
    head_packed = interleave(head)
    x, x16 = torch.randn(1, K).bfloat16(), torch.randn(16, K).bfloat16()

    def gemv() -> None:
        for p in packed:
            ops.linear_interleaved(x, p, N_SMALL, None)

    def torch_linear(rows: torch.Tensor, ws: list[torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            with torch.backends.mkldnn.flags(enabled=False):
                for w in ws:
                    F.linear(rows, w)
        return run

    codes = [_codes(N_SMALL) for _ in range(N_MATS)]
    head_codes, scale, head_scale = _codes(N_HEAD), torch.full((N_SMALL,), 1e-3), torch.full((N_HEAD,), 1e-3)

    def gemv_int8() -> None:
        for c in codes:
            ops.linear_interleaved_int8(x, c, scale, N_SMALL, None)

    small, big = N_MATS * N_SMALL * K * 2, N_HEAD * K * 2
    return {"gemv int8": (gemv_int8, small // 2),
            "lm_head int8": (lambda: ops.linear_interleaved_int8(x, head_codes, head_scale, N_HEAD, None), big // 2),
            "gemv": (gemv, small), "gemv F.linear": (torch_linear(x, mats), small),
            "gemv F.linear x16": (torch_linear(x16, mats), small),
            "lm_head": (lambda: ops.linear_interleaved(x, head_packed, N_HEAD, None), big),
            "lm_head F.linear": (torch_linear(x, [head]), big),
            "lm_head F.linear x16": (torch_linear(x16, [head]), big)}


def expert_cases() -> dict[str, tuple[Callable[[], object], int]]:
    ops = torch.ops.moeserve
    gate_up = [(torch.randn(2 * INTER, K) * K**-0.5).bfloat16() for _ in range(EXPERTS)]
    down = [(torch.randn(K, INTER) * INTER**-0.5).bfloat16() for _ in range(EXPERTS)]
    gate_up_i, down_i = [interleave(w) for w in gate_up], [interleave(w) for w in down]
    x = torch.randn(1, K).bfloat16()
    tokens, weights = torch.zeros(PER_CALL, dtype=torch.long), torch.full((PER_CALL,), 0.25)
    bounds = [b for e in range(PER_CALL) for b in (e, e + 1)]

    def run(op: Callable[..., object], gu: list[torch.Tensor], dn: list[torch.Tensor]) -> None:
        out = torch.zeros(1, K).bfloat16()
        for j in range(0, EXPERTS, PER_CALL):
            op(out, x, gu[j : j + PER_CALL], dn[j : j + PER_CALL], tokens, weights, bounds)

    def run_int8(op: Callable[..., object], packed: bool) -> Callable[[], None]:
        gu = [_codes(2 * INTER, K, packed) for _ in range(EXPERTS)]
        dn = [_codes(K, INTER, packed) for _ in range(EXPERTS)]
        gs, ds = torch.full((2 * INTER,), K**-0.5 / 64), torch.full((K,), INTER**-0.5 / 64)

        def go() -> None:
            out = torch.zeros(1, K).bfloat16()
            for j in range(0, EXPERTS, PER_CALL):
                op(out, x, gu[j : j + PER_CALL], [gs] * PER_CALL, dn[j : j + PER_CALL], [ds] * PER_CALL, tokens,
                   weights, bounds)
        return go

    nbytes = EXPERTS * 3 * INTER * K * 2
    return {"experts": (lambda: run(ops.moe_swiglu_interleaved_, gate_up_i, down_i), nbytes),
            "experts plain": (lambda: run(ops.moe_swiglu_, gate_up, down), nbytes),
            "experts int8": (run_int8(ops.moe_swiglu_int8_interleaved_, True), nbytes // 2),
            "experts int8 plain": (run_int8(ops.moe_swiglu_int8_, False), nbytes // 2)}


SOURCES = ("dense_gemv.cpp", "dense_gemv_int8.cpp", "moe_experts.cpp")  # what registers the ops benchmarked


def load_kernels(isa: str, subset: bool) -> str:
    """Loads the isa level's kernels (all, or a library of SOURCES); returns what was loaded."""
    if subset:
        try:
            path = kernels.build_subset(SOURCES, isa)
        except RuntimeError as err:
            raise SystemExit(f"error: the isa={isa} kernels are not available: {err}") from None
        torch.ops.load_library(str(path))
        return f"isa={isa}, only {', '.join(SOURCES)} ({path})"
    status = kernels.load(isa)
    if not status.available:
        raise SystemExit(f"error: the isa={isa} kernels are not available: {status.reason}")
    return status.reason


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--isa", default="native", choices=["native", "avx2", "generic"])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--subset", action="store_true",
                    help="build only the sources of the ops benchmarked (kernels.build_subset: minutes less)")
    ap.add_argument("--only", default="", help="comma-separated case names (default: all)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"kernels: {load_kernels(args.isa, args.subset)}\nthreads {args.threads}, load average at start "
          f"{os.getloadavg()}")
    flat = torch.randn(2**30 // 4)
    cases = {"stream": (lambda: flat.sum(), flat.numel() * 4), **dense_cases(), **expert_cases()}
    only = {name.strip() for name in args.only.split(",") if name.strip()}
    unknown = only - set(cases)
    if unknown:
        raise SystemExit(f"error: unknown cases {sorted(unknown)} (known: {', '.join(cases)})")
    if only:
        cases = {name: case for name, case in cases.items() if name == "stream" or name in only}
    for fn, _ in cases.values():
        fn()  # warm-up: first touch, thread pool
    rates: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(args.rounds):
        line = []
        for name, (fn, nbytes) in cases.items():
            rates[name].append(nbytes / timed(fn) / 1e9)
            line.append(f"{name} {rates[name][-1]:.1f}")
        print(f"round {r}: " + ", ".join(line) + " GB/s")
    print(f"load average at end {os.getloadavg()}")
    for name, v in rates.items():
        print(f"{name:>18}: {min(v):6.1f} {statistics.median(v):6.1f} {max(v):6.1f} GB/s (min median max)")


if __name__ == "__main__":
    main()
