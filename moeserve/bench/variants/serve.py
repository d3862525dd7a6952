"""Serving: aggregate output tokens/s with C concurrent greedy streams vs 1, and time to first token.

Starts `moeserve serve` in a child process on a free loopback port, sends token-id prompts (no tokenizer needed) to
/v1/completions with stream=True and logprobs=0 (so every chunk names its tokens), and prints a summary in the
shape of `vllm bench serve`. Without --model: a random Qwen3-MoE written by transformers (4 layers, 16 experts of
which 4 per token, hidden 256).

    moeserve bench serve --concurrency 8 --tokens 64
    moeserve bench serve --model DIR --serve-arg=--max-model-len=2048
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moeserve.bench.server_process import stream_choices
from moeserve.bench.variants import add_parser, require_positive

# the random model of a run without --model: 4 layers, 16 experts (4 per token), hidden 256
SYNTHETIC: dict[str, Any] = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=32, num_experts=16, num_experts_per_tok=4,
                 vocab_size=4096, max_position_embeddings=1024, mlp_only_layers=[], norm_topk_prob=False)


def register(sub: argparse._SubParsersAction) -> None:
    p = add_parser(sub, "serve", __doc__)
    p.add_argument("--model", type=Path, default=None, help="model folder (default: a random Qwen3-MoE built here)")
    p.add_argument("--concurrency", type=int, default=8, help="concurrent streams of the second round (default 8)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens of each stream")
    p.add_argument("--tokens", type=int, default=64, help="tokens generated per stream")
    p.add_argument("--threads", type=int, default=1,
                   help="engine compute threads (default 1: on a shared machine more threads spin and lose)")
    p.add_argument("--serve-arg", action="append", default=[], help="an extra flag for moeserve serve (repeatable)")
    p.set_defaults(func=run)


@dataclass
class StreamResult:
    ttft_s: float
    tokens: int
    seconds: float
    gaps_s: list[float]  # between consecutive chunks that carried tokens


async def _one_stream(client: Any, url: str, prompt: list[int], max_tokens: int) -> StreamResult:
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0,
            "ignore_eos": True}
    start = time.perf_counter()
    first: float | None = None
    last = start
    gaps: list[float] = []
    tokens = 0
    async for choice in stream_choices(client, url, body):  # timed as each chunk arrives
        new = len((choice.get("logprobs") or {}).get("tokens") or [])
        if not new:
            continue
        now = time.perf_counter()
        if first is None:
            first = now
        else:
            gaps.append(now - last)
        last = now
        tokens += new
    return StreamResult((first or last) - start, tokens, last - start, gaps)


async def _round(url: str, prompts: list[list[int]], max_tokens: int) -> tuple[list[StreamResult], float]:
    import httpx

    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*[_one_stream(client, url, p, max_tokens) for p in prompts])
        return list(results), time.perf_counter() - start


def _report(title: str, results: list[StreamResult], wall_s: float) -> float:
    """Print one round's summary (vllm bench serve's lines); returns its output tokens/s."""
    total = sum(r.tokens for r in results)
    ttft_ms = [1000 * r.ttft_s for r in results]
    gaps_ms = [1000 * g for r in results for g in r.gaps_s]
    tok_s = total / wall_s
    print(f"{'=' * 16} {title} {'=' * (34 - len(title))}")
    print(f"Successful requests:                 {len(results)}")
    print(f"Benchmark duration (s):              {wall_s:.2f}")
    print(f"Total generated tokens:              {total}")
    print(f"Output token throughput (tok/s):     {tok_s:.1f}")
    print(f"Mean TTFT (ms):                      {statistics.mean(ttft_ms):.1f}")
    print(f"Median TTFT (ms):                    {statistics.median(ttft_ms):.1f}")
    if gaps_ms:
        print(f"Mean ITL (ms):                       {statistics.mean(gaps_ms):.2f}")
        print(f"P99 ITL (ms):                        {sorted(gaps_ms)[int(0.99 * (len(gaps_ms) - 1))]:.2f}")
    return tok_s


def run(args: argparse.Namespace) -> int:
    from moeserve.bench.checkpoints import write_tiny_checkpoint
    from moeserve.bench.server_process import ServerProcess

    require_positive(concurrency=args.concurrency, prompt_len=args.prompt_len, tokens=args.tokens)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would bury the summary
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or write_tiny_checkpoint(Path(tmp) / "synthetic", "qwen3_moe", **SYNTHETIC)
        print(f"model: {model}{'' if args.model else ' (synthetic, random weights)'}")
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        rng = random.Random(0)
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.concurrency)]
        serve_args = ["--skip-tokenizer-init", "--max-num-seqs", str(args.concurrency), *args.serve_arg]
        serve_args += ["--threads", str(args.threads)] if args.threads else []
        with ServerProcess(model, "bench", serve_args) as server:
            asyncio.run(_round(server.url, prompts[:1], 8))  # warm-up
            one = _report("1 stream", *asyncio.run(_round(server.url, prompts[:1], args.tokens)))
            agg = _report(f"{args.concurrency} streams", *asyncio.run(_round(server.url, prompts, args.tokens)))
        print(f"{'=' * 52}\naggregate speed-up with {args.concurrency} concurrent streams: {agg / one:.2f}x "
              f"({agg:.1f} vs {one:.1f} tok/s)")
    return 0
