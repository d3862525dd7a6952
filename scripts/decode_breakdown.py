"""Where a batch-1 decode step's time goes, without a profiler's overhead: wall-clock timers around every moeserve
C++ op call and around the Python attention / MoE blocks, decode steps only (a 1-token run is subtracted).

    .venv/bin/python scripts/decode_breakdown.py ~/.cache/moeserve/bench/small-bf16 [--rounds 3] [--tokens 32]

Prints per round the milliseconds per decode step of each op, and what is left for Python and small torch ops.
Op bytes are not known here; `moeserve bench` gives bytes per token and the bandwidth ceiling.
"""

from __future__ import annotations

import argparse
import collections
import time
from collections.abc import Callable
from typing import Any

import torch

from moeserve import LLM, SamplingParams
from moeserve.models import layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32, help="decode steps timed per round")
    ap.add_argument("--expert-cache-gb", type=float, default=None)
    args = ap.parse_args()
    llm = LLM(args.model, skip_tokenizer_init=True, max_model_len=256, max_num_seqs=8,
              expert_cache_gb=args.expert_cache_gb)
    seconds: dict[str, float] = collections.defaultdict(float)

    def timed(key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                seconds[key] += time.perf_counter() - t0
        return run

    class TimedOps:  # stands in for torch.ops.moeserve: every op call is timed under its name
        def __init__(self, ops: Any) -> None:
            self._ops = ops

        def __getattr__(self, name: str) -> Any:
            return timed("op " + name, getattr(self._ops, name))

    prompt = [{"prompt_token_ids": list(range(1, 17))}]
    llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
    torch.ops.__dict__["moeserve"] = TimedOps(torch.ops.moeserve)
    layers.Attention.__call__ = timed("block Attention (ops included)", layers.Attention.__call__)  # type: ignore[method-assign]
    layers.MoEBlock.__call__ = timed("block MoEBlock (ops included)", layers.MoEBlock.__call__)  # type: ignore[method-assign]
    for _ in range(args.rounds):
        seconds.clear()
        t0 = time.perf_counter()
        llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))  # prefill + 1 step
        t1 = time.perf_counter()
        first = dict(seconds)
        llm.generate(prompt, SamplingParams(max_tokens=args.tokens + 1, temperature=0, ignore_eos=True))
        t2 = time.perf_counter()
        step = ((t2 - t1) - (t1 - t0)) / args.tokens
        per_step = {k: (v - 2 * first.get(k, 0.0)) / args.tokens for k, v in seconds.items()}
        ops = sum(v for k, v in per_step.items() if k.startswith("op "))
        print(f"decode step {step * 1e3:.2f} ms ({1 / step:.1f} tok/s); all moeserve ops {ops * 1e3:.2f} ms, "
              f"the rest (Python, small torch ops, sampling) {(step - ops) * 1e3:.2f} ms ({100 * (step - ops) / step:.0f}%)")
        for k in sorted(per_step, key=lambda k: -per_step[k]):
            print(f"    {k:40s} {per_step[k] * 1e3:7.3f} ms  {100 * per_step[k] / step:5.1f}%")


if __name__ == "__main__":
    main()
