"""Streaming speed of the 4-bit expert op (moe_q4_experts_: MXFP4 / NVFP4 / INT4 codes decoded in registers) at
batch 1, against the canonical bf16 expert op on the same expert shape and a stream-read ceiling.

    .venv/bin/python research/bench_q4_experts.py [--isa native|avx2|generic] [--rounds 5] [--threads 2]

One token through 4 experts per call (a decode step's top-k of one layer), over 64 Qwen3-30B-sized SwiGLU experts
([2I=1536 x H=2048] + [2048 x 768]) so the weights stream from memory, not the caches. Each round runs every case
once, in this order, so a busy machine slows them alike (report the ranges over rounds):
- stream: torch.sum over a 1 GiB fp32 buffer (a streaming read: the practical ceiling);
- bf16: `moe_swiglu_interleaved_` (the canonical bf16 op, row-interleaved units);
- mxfp4 / nvfp4 / int4-g32 / int4-g128: `moe_q4_experts_` on units as the plans hold them (compressed-tensors
  layouts; codes + group scales, read as stored);
- int4-q8: the int4-g32 units as quantization="int4" computes them (int8-quantized activations, csrc/q4_q8.h).
Prints, per case, GB/s of the bytes each call reads (codes and scales), ms per token (64 experts = 16 calls)
and bytes per token of one layer's 4 experts; then min-median-max over rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from moeserve import kernels
from moeserve.bench.q4_units import ProjectionShape, Units, assemble
from moeserve.formats import create_format
from moeserve.models.experts.fused_spec import Activation

K, INTER, EXPERTS, PER_CALL = 2048, 768, 64, 4
SHAPES = (ProjectionShape(2 * INTER, K, 2), ProjectionShape(K, INTER, 1))  # gate and up stored apart, as Qwen's


def interleave(w: torch.Tensor) -> torch.Tensor:
    """The row-interleaved layout of canonical_dot.h (N % 4 == 0 here)."""
    n, k = w.shape
    return w.reshape(n // 4, 4, k // 32, 32).permute(0, 2, 1, 3).reshape(-1).contiguous()


def stored_weight(fmt: str, rows: int, cols: int, group: int) -> dict[str, torch.Tensor]:
    """Random stored tensors of one weight in a compressed-tensors layout, scales in a typical range."""
    codes = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8)
    if fmt == "mxfp4-ct":
        return {"weight_packed": codes, "weight_scale": torch.randint(118, 124, (rows, cols // 32), dtype=torch.uint8)}
    if fmt == "nvfp4-ct":
        scales = torch.randint(0x30, 0x48, (rows, cols // 16), dtype=torch.uint8).view(torch.float8_e4m3fn)
        return {"weight_packed": codes, "weight_scale": scales,
                "weight_global_scale": torch.tensor([448.0 * 6 / 4], dtype=torch.float32)}
    return {"weight_packed": codes.view(torch.int32),
            "weight_scale": (torch.rand(rows, cols // group) * 0.01 + 0.001).bfloat16(),
            "weight_shape": torch.tensor([rows, cols], dtype=torch.int64)}


def q4_units(fmt: str, group: int, int8_activations: bool = False) -> Units:
    f = create_format(fmt, **({"group_size": group} if fmt == "int4-ct" else {}))
    stored = [[stored_weight(fmt, p.rows // p.shards, p.cols, group) for p in SHAPES for _ in range(p.shards)]
              for _ in range(EXPERTS)]
    return assemble(f, SHAPES, stored, [[None, None]] * EXPERTS, Activation("swiglu"), int8_activations)


def cases() -> dict[str, tuple[Callable[[], object], int]]:
    """name -> (one token through every expert, bytes it reads)."""
    ops = torch.ops.moeserve
    x = torch.randn(1, K).bfloat16()
    tokens, weights = torch.zeros(PER_CALL, dtype=torch.long), torch.full((PER_CALL,), 0.25)
    bounds = [b for e in range(PER_CALL) for b in (e, e + 1)]
    gate_up = [interleave((torch.randn(2 * INTER, K) * K**-0.5).bfloat16()) for _ in range(EXPERTS)]
    down = [interleave((torch.randn(K, INTER) * INTER**-0.5).bfloat16()) for _ in range(EXPERTS)]

    def bf16() -> None:
        out = torch.zeros(1, K).bfloat16()
        for j in range(0, EXPERTS, PER_CALL):
            ops.moe_swiglu_interleaved_(out, x, gate_up[j : j + PER_CALL], down[j : j + PER_CALL], tokens, weights,
                                        bounds)

    def q4(units: Units) -> Callable[[], None]:
        calls = [units.op_args(range(j, j + PER_CALL)) for j in range(0, EXPERTS, PER_CALL)]

        def run() -> None:
            out = torch.zeros(1, K).bfloat16()
            for gu, dn, spec in calls:
                ops.moe_q4_experts_(out, x, gu, dn, tokens, weights, bounds, spec)
        return run

    found = {"bf16": (bf16, EXPERTS * 3 * INTER * K * 2)}
    for name, fmt, group in (("mxfp4", "mxfp4-ct", 32), ("nvfp4", "nvfp4-ct", 16), ("int4-g32", "int4-ct", 32),
                             ("int4-g128", "int4-ct", 128), ("int4-q8", "int4-ct", 32)):
        units = q4_units(fmt, group, int8_activations=name == "int4-q8")
        found[name] = (q4(units), EXPERTS * units.layout.nbytes)
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--isa", default="native", choices=["native", "avx2", "generic"])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    status = kernels.load(args.isa)
    if not status.available:
        raise SystemExit(f"error: the isa={args.isa} kernels are not available: {status.reason}")
    torch.set_num_threads(args.threads)
    print(f"kernels: {status.reason}\nthreads {args.threads}, load average at start {os.getloadavg()}")
    flat = torch.randn(2**30 // 4)
    all_cases = {"stream": (lambda: flat.sum(), flat.numel() * 4), **cases()}
    for fn, _ in all_cases.values():
        fn()  # warm-up: first touch, thread pool
    secs: dict[str, list[float]] = {name: [] for name in all_cases}
    for r in range(args.rounds):
        line = []
        for name, (fn, nbytes) in all_cases.items():
            t0 = time.perf_counter()
            fn()
            secs[name].append(time.perf_counter() - t0)
            line.append(f"{name} {nbytes / secs[name][-1] / 1e9:.1f}")
        print(f"round {r}: " + ", ".join(line) + " GB/s")
    print(f"load average at end {os.getloadavg()}")
    for name, v in secs.items():
        nbytes = all_cases[name][1]
        rates = sorted(nbytes / s / 1e9 for s in v)
        per_token = "" if name == "stream" else (
            f"   {statistics.median(v) * 1e3 * PER_CALL / EXPERTS:6.2f} ms/token-layer, "
            f"{nbytes * PER_CALL / EXPERTS / 2**20:5.2f} MiB/token-layer")
        print(f"{name:>10}: {rates[0]:6.1f} {statistics.median(rates):6.1f} {rates[-1]:6.1f} GB/s (min median max)"
              + per_token)


if __name__ == "__main__":
    main()
