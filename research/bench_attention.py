"""Speed of the attention op (decode_attention) on a bench shape, this tree against another (the previous commit's),
alternated round by round, with a stream-read ceiling measured beside it.

    .venv/bin/python research/bench_attention.py --before /work/main [--isa native] [--rounds 3] [--threads 2]

Each tree's attention sources are built as a library of their own (kernels.build_subset, the full library's objects)
and run in a subprocess (one library per process), the trees alternating within each round so that a busy machine
slows them alike. The shape is Qwen3-30B-A3B's attention (32 query heads, 4 kv heads, head dim 128, bf16, 16-token
blocks in shuffled order). Cases:
- prefill C: a chunk of CHUNK new tokens at positions C - CHUNK .. C - 1 (each against the keys up to its own
  position, as the engine's batch-invariant prefill calls the op): tokens/s, and GFLOP/s of the q.k and p.v dots;
- decode C: one token at position C - 1: GB/s of the keys and values it reads;
- stream: torch.sum over a 1 GiB fp32 buffer (the practical read ceiling).
Prints per round, then min-median-max per case and tree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

NH, NKV, D, BS = 32, 4, 128, 16
CHUNK = 256
CONTEXTS = (128, 4096, 32768)
SOURCES_NOW = ("attention.cpp", "attention_core.cpp", "mla_attention.cpp")


def build(tree: Path, isa: str) -> str:
    """The library of `tree`'s attention sources (built in a subprocess importing that tree's moeserve)."""
    names = tuple(n for n in SOURCES_NOW if (tree / "moeserve/kernels/csrc" / n).exists())
    code = f"from moeserve import kernels; print(kernels.build_subset({names!r}, {isa!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(tree)}, cwd=tree)
    return out.stdout.strip().splitlines()[-1]


def cache(context: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    blocks = -(-context // BS)
    k = (torch.randn(blocks, NKV, BS, D, generator=gen) * 0.5).bfloat16()
    v = torch.randn(blocks, NKV, BS, D, generator=gen).bfloat16()
    return k, v, torch.randperm(blocks, generator=gen)[None]


def run_cases(library: str, threads: int) -> dict[str, float]:
    """Seconds per case with `library` loaded (the subprocess side)."""
    torch.ops.load_library(library)
    torch.set_num_threads(threads)
    op = torch.ops.moeserve.decode_attention
    gen = torch.Generator().manual_seed(0)
    times: dict[str, float] = {}
    for c in CONTEXTS:
        k, v, table = cache(c, gen)
        n = min(CHUNK, c)
        q = torch.randn(n, NH, D, generator=gen).bfloat16()
        pos = torch.arange(c - n, c)
        rows = torch.zeros(n, dtype=torch.long)
        op(q[-1:], k, v, table, rows[:1], pos[-1:], 0, D**-0.5, None)  # warm-up
        t0 = time.perf_counter()
        op(q, k, v, table, rows, pos, 0, D**-0.5, None)
        times[f"prefill {c}"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        reps = 20
        for _ in range(reps):
            op(q[-1:], k, v, table, rows[:1], pos[-1:], 0, D**-0.5, None)
        times[f"decode {c}"] = (time.perf_counter() - t0) / reps
    return times


def rate(case: str, seconds: float) -> tuple[float, str, str]:
    """(the case's rate, its unit, a second figure: prefill's GFLOP/s of the dots)."""
    kind, c = case.split()
    context = int(c)
    if kind == "prefill":
        n = min(CHUNK, context)
        keys = sum(range(context - n + 1, context + 1))  # keys attended, all rows together
        return n / seconds, "tok/s", f"{4 * NH * D * keys / seconds / 1e9:.1f} GFLOP/s"
    return 2 * context * NKV * D * 2 / seconds / 1e9, "GB/s", ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, required=True, help="the tree to compare with (e.g. /work/main)")
    ap.add_argument("--isa", default="native", choices=["native", "avx2", "generic"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--run", help=argparse.SUPPRESS)  # subprocess side: a library path
    args = ap.parse_args()
    if args.run:
        print(json.dumps(run_cases(args.run, args.threads)))
        return
    here = Path(__file__).resolve().parents[1]
    libs = {"before": build(args.before.resolve(), args.isa), "after": build(here, args.isa)}
    print(f"isa={args.isa}, threads {args.threads}, load average at start {os.getloadavg()}")
    flat = torch.randn(2**30 // 4)
    flat.sum()
    results: dict[str, dict[str, list[float]]] = {name: {} for name in libs}
    stream: list[float] = []
    for r in range(args.rounds):
        t0 = time.perf_counter()
        flat.sum()
        stream.append(flat.numel() * 4 / (time.perf_counter() - t0) / 1e9)
        for name, lib in libs.items():
            out = subprocess.run([sys.executable, __file__, "--before", str(args.before), "--threads",
                                  str(args.threads), "--run", lib], capture_output=True, text=True, check=True)
            for case, s in json.loads(out.stdout.strip().splitlines()[-1]).items():
                results[name].setdefault(case, []).append(s)
            print(f"round {r} {name}: " + ", ".join(f"{c} {rate(c, v[-1])[0]:.1f}" for c, v in results[name].items()),
                  flush=True)
    print(f"load average at end {os.getloadavg()}; stream {min(stream):.1f}-{max(stream):.1f} GB/s")
    for case in results["after"]:
        for name in libs:
            secs = results[name][case]
            v = sorted(rate(case, s)[0] for s in secs)
            _, unit, extra = rate(case, statistics.median(secs))
            print(f"{case:>14} {name:>6}: {v[0]:8.1f} {statistics.median(v):8.1f} {v[-1]:8.1f} {unit} "
                  f"(min median max) {extra}")


if __name__ == "__main__":
    main()
