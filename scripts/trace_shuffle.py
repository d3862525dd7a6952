"""Permutation test of a routing trace: how much of demand-only Belady's lead over online policies comes from the
ORDER of the tokens (locality an online policy could learn) and how much from knowing a future that the past does
not reveal.

Writes shuffled copies of a trace as JSON lines: the steps (forward passes) are permuted at random within the
fitting part and within the evaluated part separately (the simulator's split, `--warmup-fraction`), each step kept
whole (every layer's choices of its tokens travel together, so the within-token correlation between layers that a
cross-layer predictor uses is kept). The evaluated multiset of steps is unchanged, so frequency-based bounds (the
best static choice) are identical; only temporal order is destroyed. Then run scripts/policy_table.py on the
original and on each copy and compare (docs/flame-bound.md):

    .venv/bin/python scripts/trace_shuffle.py /work/shared/traces/flame-moe-290m --out /tmp/shuf --seeds 1,2,3
    .venv/bin/python scripts/policy_table.py /tmp/shuf/seed1.jsonl --capacity 64,128,256 --policy lru,lfru,belady

If a cell barely moves when the order is destroyed, the policy's result in that cell owes nothing to temporal
locality; in particular, if Belady's hit rate survives shuffling, its lead is the knowledge of which of several
near-equally likely experts the next tokens happen to pick: on an exchangeable stream no online policy can have
that (for independent references, keeping the most probable experts is the optimal online demand policy, and its
hit rate is the best static choice's).
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from moeserve.bench.traces import load_trace, write_trace


def shuffled(steps: list, warmup_fraction: float, seed: int) -> list:
    """`steps` with the fitting part and the evaluated part each permuted at random (steps kept whole)."""
    split = int(len(steps) * warmup_fraction)
    rng = random.Random(seed)
    fit, evaluated = steps[:split], steps[split:]
    rng.shuffle(fit)
    rng.shuffle(evaluated)
    return fit + evaluated


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", help="any trace moeserve reads (folder of FLAME CSVs, .jsonl, moetrace)")
    ap.add_argument("--out", required=True, help="folder for seed<N>.jsonl (and original.jsonl)")
    ap.add_argument("--seeds", default="1,2,3", help="comma-separated shuffle seeds")
    ap.add_argument("--warmup-fraction", type=float, default=0.5, help="the simulator's split (default 0.5)")
    args = ap.parse_args()
    trace = load_trace(args.trace)
    steps = list(trace.steps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_trace(out / "original.jsonl", trace.header, steps, "jsonl")
    for seed in (int(s) for s in args.seeds.split(",") if s):
        n = write_trace(out / f"seed{seed}.jsonl", trace.header, shuffled(steps, args.warmup_fraction, seed), "jsonl")
        print(f"{out / f'seed{seed}.jsonl'}: {n} steps, fitting and evaluated parts each permuted (seed {seed})")


if __name__ == "__main__":
    main()
