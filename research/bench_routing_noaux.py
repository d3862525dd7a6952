"""Time of one noaux_tc routing call (DeepSeek-V3's router from tests/data/reference_configs: 256 experts, 8 groups,
4 kept, top 8), in fixed row blocks as under batch_invariant: the torch ops (moe.SigmoidGroups) vs the C++ op
(moe.CppSigmoidGroups), alternated round by round, per batch size; printed, no assertion. Random fp32 logits.

    .venv/bin/python research/bench_routing_noaux.py [--rounds 7] [--calls 200] [--batches 1 64 2048]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from moeserve import kernels
from moeserve.models.experts.moe import CppSigmoidGroups, SigmoidGroups
from moeserve.models.numerics import Numerics
from moeserve.models.registry import get_architecture

# a published config.json (the copy in the checkout's tests/data; read as data, nothing of tests is imported)
CONFIG = Path(__file__).resolve().parents[1] / "tests" / "data" / "reference_configs" / "DeepSeek-V3.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 2048])
    args = ap.parse_args()
    status = kernels.load()
    if not status.available:
        sys.exit(f"bench_routing_noaux: the C++ kernels are not available: {status.reason}")
    config = json.loads(CONFIG.read_text())
    moe = get_architecture(config, str(CONFIG)).spec(config, str(CONFIG)).moe
    assert moe is not None
    gen = torch.Generator().manual_seed(0)
    bias = torch.randn(moe.num_experts, generator=gen) * 0.1
    numerics = Numerics(cpp=True, batch_invariant=True)  # row blocks of the default 16 rows
    routings = {"torch": SigmoidGroups(moe, bias, numerics), "cpp": CppSigmoidGroups(moe, bias, numerics)}
    print(f"DeepSeek-V3 noaux_tc routing, row blocks on, {torch.get_num_threads()} threads, {args.rounds} rounds x "
          f"{args.calls} calls, alternated")
    for n in args.batches:
        x, logits = torch.zeros(n, 8), torch.randn(n, moe.num_experts, generator=gen)
        times: dict[str, list[float]] = {name: [] for name in routings}
        for _ in range(args.rounds):
            for name, routing in routings.items():
                routing.route(x, logits)
                begin = time.perf_counter()
                for _ in range(args.calls):
                    routing.route(x, logits)
                times[name].append((time.perf_counter() - begin) / args.calls * 1e6)
        ratios = [a / b for a, b in zip(times["torch"], times["cpp"])]
        print(f"batch {n:5d}: torch {statistics.median(times['torch']):9.0f} us  cpp "
              f"{statistics.median(times['cpp']):8.0f} us  torch/cpp {statistics.median(ratios):4.1f}x "
              f"(rounds {min(ratios):.1f}-{max(ratios):.1f})")


if __name__ == "__main__":
    main()
