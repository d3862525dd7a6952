"""Serving benchmark: aggregate output tokens/s with C concurrent greedy streams vs 1, and time to first token.

    .venv/bin/python scripts/bench_serve.py                      # a synthetic random Qwen3-MoE model
    .venv/bin/python scripts/bench_serve.py --model DIR --concurrency 8 --max-tokens 64

Starts `moeserve serve` in a subprocess on a free loopback port, sends token-id prompts (no tokenizer needed) to
/v1/completions with stream=True and logprobs=0 (so every chunk names its tokens), and prints a summary in the
shape of `vllm bench serve`. Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def build_synthetic_model(folder: Path) -> Path:
    """A random-init Qwen3-MoE written by transformers: 4 layers, 16 experts of which 4 per token."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3_moe", hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                                  num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                                  num_experts=16, num_experts_per_tok=4, vocab_size=4096,
                                  max_position_embeddings=1024)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


@dataclass
class StreamResult:
    ttft_s: float
    tokens: int
    seconds: float
    gaps_s: list[float]


async def one_stream(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> StreamResult:
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0,
            "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    first: float | None = None
    last = start
    gaps: list[float] = []
    tokens = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            new = len((chunk["choices"][0].get("logprobs") or {}).get("tokens") or [])
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


async def run_round(url: str, prompts: list[list[int]], max_tokens: int) -> tuple[list[StreamResult], float]:
    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*[one_stream(client, url, p, max_tokens) for p in prompts])
        return list(results), time.perf_counter() - start


def report(title: str, results: list[StreamResult], wall_s: float) -> float:
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


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit("server did not become healthy")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="model folder (default: build a synthetic random model)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1,
                        help="engine CPU threads (default 1: on a shared machine more threads spin and lose)")
    parser.add_argument("--serve-arg", action="append", default=[], help="extra flag for moeserve serve")
    args = parser.parse_args()

    tmp = tempfile.TemporaryDirectory()
    model = Path(args.model) if args.model else build_synthetic_model(Path(tmp.name) / "synthetic")
    print(f"model: {model}{'' if args.model else ' (synthetic, random weights)'}")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.concurrency)]

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "moeserve", "serve", str(model), "--port", str(port), "--served-model-name",
           "bench", "--skip-tokenizer-init", "--max-num-seqs", str(max(args.concurrency, 1)), *args.serve_arg]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_healthy(url, proc)
        asyncio.run(run_round(url, prompts[:1], 8))  # warm-up
        single, single_wall = asyncio.run(run_round(url, prompts[:1], args.max_tokens))
        one = report("1 stream", single, single_wall)
        many, many_wall = asyncio.run(run_round(url, prompts, args.max_tokens))
        agg = report(f"{args.concurrency} streams", many, many_wall)
        print(f"{'=' * 52}\naggregate speed-up with {args.concurrency} concurrent streams: {agg / one:.2f}x "
              f"({agg:.1f} vs {one:.1f} tok/s)")
    finally:
        proc.terminate()
        proc.wait(60)
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
