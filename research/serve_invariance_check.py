"""Batch invariance through the server, as a user meets it: C concurrent streaming completions at temperature 0
(staggered, so prompts are prefilled while others decode), each compared with the same request sent alone.

    .venv/bin/python research/serve_invariance_check.py [--model DIR] [--concurrency 16] [--rounds 3]
    .venv/bin/python research/serve_invariance_check.py --serve-arg=--no-batch-invariant   # the other mode

Without --model it builds a Qwen3-30B-A3B-dimension checkpoint truncated to 2 layers (moeserve/bench/real_dims.py,
cached under ~/.cache/moeserve/bench/real-dims). Prints how many requests differed from their solo run (tokens or
logprobs) in each round; exits 1 if any did.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from pathlib import Path
from typing import Any

import httpx

from moeserve.bench.real_dims import write_real_dims
from moeserve.bench.server_process import ServerProcess, stream_choices
from moeserve.bench.synth import default_cache_dir


async def one(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int, delay: float) -> list[Any]:
    """(token, logprob) per generated token of a streamed greedy completion sent after `delay` seconds."""
    await asyncio.sleep(delay)
    body = {"model": "check", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1,
            "ignore_eos": True}
    got: list[Any] = []
    async for choice in stream_choices(client, url, body):
        lp = choice.get("logprobs") or {}
        got += list(zip(lp.get("tokens") or [], lp.get("token_logprobs") or []))
    return got


async def run(url: str, prompts: list[list[int]], max_tokens: int, delays: list[float]) -> list[list[Any]]:
    async with httpx.AsyncClient(timeout=900) as client:
        return list(await asyncio.gather(*[one(client, url, p, max_tokens, d) for p, d in zip(prompts, delays)]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--serve-arg", action="append", default=[])
    args = ap.parse_args()
    model = args.model or default_cache_dir() / "real-dims" / "Qwen3-30B-A3B"
    if not (model / "config.json").exists():
        write_real_dims(model, "Qwen3-30B-A3B")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rng = random.Random(1)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(4, 60))] for _ in range(args.concurrency)]
    serve_args = ["--skip-tokenizer-init", "--max-num-seqs", "8", "--max-model-len", "256", *args.serve_arg]
    bad = 0
    with ServerProcess(model, "check", serve_args) as server:
        solo = [asyncio.run(run(server.url, [p], args.max_tokens, [0.0]))[0] for p in prompts]
        for r in range(args.rounds):
            delays = [rng.uniform(0, 1.5) for _ in prompts]
            got = asyncio.run(run(server.url, prompts, args.max_tokens, delays))
            diff = [i for i, (a, b) in enumerate(zip(got, solo)) if a != b]
            bad += len(diff)
            print(f"round {r + 1}: {len(diff)} of {len(prompts)} concurrent requests differ from their solo run"
                  + (f" (requests {diff})" if diff else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
