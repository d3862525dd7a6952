"""Does `moeserve simulate` give the engine's hits and misses on a bench shape under trace-driven routing? (issue 19)

The engine decodes as `moeserve bench` does (batch 1, random prompts, greedy) on a bench shape's synthetic model
(built by `moeserve bench --build-only`), its experts forced to follow a routing trace (bench/route_trace.py),
while it records the layer calls it actually made; the store's per-layer (hits, misses) and bypasses are then set
beside `simulate(...)` replaying that recorded trace at the same capacity, with and without admission control.

    .venv/bin/python research/policy_bench_replay.py --shape large --fraction 0.25 \\
        --route-trace /work/shared/traces/flame-moe-290m --prompts 3 --tokens 32

Counts only: no timing, so the machine's load does not matter.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from moeserve.bench.engines import MoeserveEngine
from moeserve.bench.runner import make_prompts
from moeserve.bench.shapes import get_shape
from moeserve.bench.simulate import calls_from_steps, simulate
from moeserve.bench.synth import default_cache_dir, ensure_checkpoint
from moeserve.experts.traces.moetrace import read_trace


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="large")
    p.add_argument("--fraction", type=float, default=0.25, help="expert cache, a fraction of all experts")
    p.add_argument("--route-trace", type=Path, required=True)
    p.add_argument("--policy", default="lfru")
    p.add_argument("--admission", default="always,policy", help="expert_admission values to run, in order")
    p.add_argument("--prompts", type=int, default=3, help="sequences decoded one after another (batch 1)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--cache-dir", type=Path, default=None, help="where bench models are cached (bench's default)")
    return p.parse_args(argv)


def run_one(args: argparse.Namespace, admission: str, trace: Path) -> tuple[bool, str]:
    """Decode with `admission` while recording the trace; (the simulator agrees, one line of figures)."""
    shape = get_shape(args.shape)
    folder = ensure_checkpoint(shape, args.cache_dir or default_cache_dir())
    count = max(1, round(args.fraction * shape.total_experts))  # as `moeserve bench --expert-cache-fraction`
    cache_gb = (count + 0.5) * shape.expert_params * 2 / 2**30
    engine = MoeserveEngine(str(folder), route_trace=str(args.route_trace), dtype="bfloat16", threads=1,
                            expert_cache_gb=cache_gb, cache_policy=args.policy, expert_admission=admission,
                            record_trace=str(trace), max_model_len=args.prompt_len + args.tokens + 8)
    store = engine.engine.model.store
    try:
        for i in range(args.prompts):
            engine.decode(make_prompts(1, args.prompt_len, shape.vocab_size, i), args.tokens)
        counts = {layer: (s.hits, s.misses) for layer, s in sorted(store.stats.layers.items())}
        stats, capacity = store.stats, store.capacity
    finally:
        engine.close()
    sim = simulate(calls_from_steps(read_trace(trace)), args.policy, capacity, admission=admission == "policy")
    same = sim.per_layer == counts and sim.bypassed == stats.bypassed
    worst = max((abs(sim.per_layer.get(k, (0, 0))[0] - v[0]) for k, v in counts.items()), default=0)
    return same, (f"{admission:>6}: {capacity} slots, engine hit rate {stats.hit_rate:.4f} ({stats.hits} hits, "
                  f"{stats.misses} misses, {stats.bypassed} bypassed); simulate on its recorded trace "
                  f"{sim.hit_rate:.4f} ({sim.hits} hits, {sim.misses} misses, {sim.bypassed} bypassed); per layer "
                  f"{'EQUAL' if same else f'DIFFERENT (largest hits difference {worst})'}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"shape {args.shape}, cache {args.fraction:.0%} of the experts, policy {args.policy}, route trace "
          f"{args.route_trace}, {args.prompts} x ({args.prompt_len} prompt + {args.tokens} decoded) tokens",
          flush=True)
    all_same = True
    with tempfile.TemporaryDirectory() as tmp:
        for admission in args.admission.split(","):
            same, line = run_one(args, admission, Path(tmp) / f"{admission}.moetrace")
            all_same &= same
            print(line, flush=True)
    return 0 if all_same else 1


if __name__ == "__main__":
    sys.exit(main())
