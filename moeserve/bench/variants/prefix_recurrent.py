"""Time to first token of a request that shares a long prefix, with recurrent prefix snapshots and without.

Default model: Qwen3.5-35B-A3B's dimensions (4 layers: 3 Gated DeltaNet + 1 gated attention, 12 experts;
moeserve/bench/real_dims.py writes it once into the cache), bf16, default settings; --model takes any checkpoint
with recurrent layers instead. Per round and engine (prefix caching on, then off, alternated in one process): a fresh
shared prefix S of --shared tokens, requests S + a and S + b (the second leaves a snapshot where it leaves S), then
S + c timed (one token: prefill + the first sample). Prints each engine's median seconds for S + c, the tokens it
computed, and the paired ratio.

    moeserve bench prefix-recurrent --shared 960 --repeats 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path
from typing import Any

from moeserve.bench.variants import add_parser, add_repeats_flag, require_positive

TAILS = (40, 50)  # the own tokens of S + a and S + b
TIMED_TAIL = 30  # of S + c


def register(sub: argparse._SubParsersAction) -> None:
    p = add_parser(sub, "prefix-recurrent", __doc__)
    p.add_argument("--model", type=Path, default=None,
                   help="checkpoint folder (default: Qwen3.5-35B-A3B's dimensions, written into --cache-dir once)")
    p.add_argument("--cache-dir", type=Path, default=None, help="where the default checkpoint is cached "
                   "(default ~/.cache/moeserve/bench)")
    p.add_argument("--shared", type=int, default=960, help="tokens of the shared prefix (default 960)")
    add_repeats_flag(p, 3)
    p.set_defaults(func=run)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(300) for _ in range(n)]  # ids every vocabulary has


def _time_round(llm: Any, rng: random.Random, shared: int) -> tuple[float, int]:
    """(seconds for S + c's first token, prompt tokens it computed) after S + a and S + b."""
    from moeserve.engine.sampling_params import SamplingParams

    s = _prompt(rng, shared)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for tail in TAILS:
        llm.generate([{"prompt_token_ids": s + _prompt(rng, tail)}], one)
    stats = llm.engine.scheduler.stats
    before = stats.prefill_tokens
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": s + _prompt(rng, TIMED_TAIL)}], one)
    return time.perf_counter() - t0, stats.prefill_tokens - before


def run(args: argparse.Namespace) -> int:
    from moeserve.bench.real_dims import write_qwen35
    from moeserve.bench.synth import default_cache_dir
    from moeserve.engine.llm import LLM

    require_positive(shared=args.shared, repeats=args.repeats)
    folder = args.model or (args.cache_dir or default_cache_dir()) / "real-dims" / "Qwen3.5-35B-A3B"
    if not (folder / "config.json").exists():
        print(f"writing Qwen3.5-35B-A3B's dimensions into {folder} ...", flush=True)
        folder.mkdir(parents=True, exist_ok=True)
        write_qwen35(folder)
    max_len = args.shared + max(TAILS) + 2  # the longest prompt and its one token
    engines = {name: LLM(str(folder), skip_tokenizer_init=True, max_model_len=max_len, enable_prefix_caching=on)
               for name, on in (("snapshots", True), ("off", False))}
    times: dict[str, list[float]] = {name: [] for name in engines}
    tokens: dict[str, int] = {}
    for r in range(args.repeats):
        for name, llm in engines.items():  # the same prompts for both in a round
            seconds, tokens[name] = _time_round(llm, random.Random(r), args.shared)
            times[name].append(seconds)
    for name in engines:
        print(f"{name:9s}: S + c first token {statistics.median(times[name]):.3f} s median of "
              f"{[round(t, 3) for t in times[name]]}, {tokens[name]} prompt tokens computed")
    ratios = [b / a for a, b in zip(times["snapshots"], times["off"])]
    print(f"off / snapshots, paired per round: {[round(x, 2) for x in ratios]} (median {statistics.median(ratios):.2f}x)")
    for llm in engines.values():
        llm.engine.close()
    return 0
