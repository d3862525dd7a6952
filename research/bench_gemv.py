"""Streaming speed of the C++ weight kernels against a plain fp32 sum over the same bytes, alternated.

    .venv/bin/python research/bench_gemv.py [--threads 2]

Per round: the fused MoE op (`moe_swiglu_`, one token, 4 experts of the small bench shape per call), the same on
units in the row-interleaved layout (`moe_swiglu_interleaved_`), the dense
bf16 GEMV on the row-interleaved layout (`linear_interleaved`, the same matrices), its int8 variant
(`linear_interleaved_int8`, the same matrices quantized per row: half the bytes), and `torch.sum` over an fp32
buffer of the bf16 matrices' size (a streaming read, the practical ceiling). Prints median GB/s (of the bytes
each case reads) and milliseconds over the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from moeserve import kernels
from moeserve.formats.int8 import quantize_int8_per_channel
from moeserve.models.layers.linear import interleave_rows, pack_int8_rows

H, INTER, E = 1024, 512, 96  # hidden, expert intermediate, experts streamed per round (288 MiB of bf16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    status = kernels.load()
    if not status.available:
        raise SystemExit(f"error: the C++ kernels are not available: {status.reason}")
    torch.set_num_threads(args.threads)
    ops = torch.ops.moeserve
    gate_ups = [torch.randn(2 * INTER, H).bfloat16() for _ in range(E)]
    downs = [torch.randn(H, INTER).bfloat16() for _ in range(E)]
    gate_ups_i = [interleave_rows(g) for g in gate_ups]
    downs_i = [interleave_rows(d) for d in downs]
    x, xi = torch.randn(1, H).bfloat16(), torch.randn(1, INTER).bfloat16()
    tokens, weights = torch.zeros(4, dtype=torch.long), torch.ones(4)
    nbytes = E * 3 * H * INTER * 2
    flat = torch.randn(nbytes // 4)

    def fused() -> None:
        out = torch.zeros(1, H).bfloat16()
        for j in range(0, E, 4):
            ops.moe_swiglu_(out, x, gate_ups[j : j + 4], downs[j : j + 4], tokens, weights, [0, 1, 1, 2, 2, 3, 3, 4])

    def fused_interleaved() -> None:
        out = torch.zeros(1, H).bfloat16()
        for j in range(0, E, 4):
            ops.moe_swiglu_interleaved_(out, x, gate_ups_i[j : j + 4], downs_i[j : j + 4], tokens, weights,
                                        [0, 1, 1, 2, 2, 3, 3, 4])

    def dense() -> None:
        for j in range(E):
            ops.linear_interleaved(x, gate_ups_i[j], 2 * INTER, None)
            ops.linear_interleaved(xi, downs_i[j], H, None)

    q_gu = [quantize_int8_per_channel(g) for g in gate_ups]
    q_d = [quantize_int8_per_channel(d) for d in downs]
    gu8 = [(pack_int8_rows(q), s) for q, s in q_gu]
    d8 = [(pack_int8_rows(q), s) for q, s in q_d]

    def dense_int8() -> None:
        for j in range(E):
            ops.linear_interleaved_int8(x, gu8[j][0], gu8[j][1], 2 * INTER, None)
            ops.linear_interleaved_int8(xi, d8[j][0], d8[j][1], H, None)

    cases: dict[str, Callable[[], object]] = {"fused MoE op": fused, "fused MoE op, interleaved": fused_interleaved,
                                              "interleaved GEMV": dense,
                                              "int8 interleaved GEMV": dense_int8, "fp32 sum": flat.sum}
    case_bytes = {name: nbytes // 2 if name.startswith("int8") else nbytes for name in cases}
    speeds: dict[str, list[float]] = {name: [] for name in cases}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            times[name].append(dt)
            speeds[name].append(case_bytes[name] / dt / 1e9)
    print(f"threads {args.threads}: " + ", ".join(
        f"{n} {statistics.median(v):.1f} GB/s ({1e3 * statistics.median(times[n]):.1f} ms)" for n, v in speeds.items()))


if __name__ == "__main__":
    main()
