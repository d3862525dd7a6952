"""Time to first token of a request that shares a long prefix, with recurrent prefix snapshots and without.

Qwen3.5-35B-A3B's dimensions (4 layers: 3 Gated DeltaNet + 1 gated attention, 12 experts; the checkpoint
tests/models/real_dims_checkpoints.py writes, into --folder once), bf16, default settings. Per round and engine
(prefix caching on, then off, alternated in one process): a fresh shared prefix S of --shared tokens, requests
S + a and S + b (the second leaves a snapshot where it leaves S), then S + c timed (one token: prefill + the first
sample). Prints each engine's median seconds for S + c, the tokens it computed, and the paired ratio.

    .venv/bin/python scripts/bench_prefix_recurrent.py --folder /tmp/qwen35-real-dims --shared 960 --rounds 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moeserve import LLM, SamplingParams  # noqa: E402
from moeserve.bench.real_dims import write_qwen35  # noqa: E402


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(300) for _ in range(n)]


def time_round(llm: LLM, rng: random.Random, shared: int) -> tuple[float, int]:
    """(seconds for S + c's first token, prompt tokens it computed) after S + a and S + b."""
    s = prompt(rng, shared)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for tail in (40, 50):
        llm.generate([{"prompt_token_ids": s + prompt(rng, tail)}], one)
    stats = llm.engine.scheduler.stats
    before = stats.prefill_tokens
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": s + prompt(rng, 30)}], one)
    return time.perf_counter() - t0, stats.prefill_tokens - before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--folder", type=Path, required=True, help="the checkpoint (written there when absent)")
    ap.add_argument("--shared", type=int, default=960, help="tokens of the shared prefix")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not (args.folder / "config.json").exists():
        args.folder.mkdir(parents=True, exist_ok=True)
        write_qwen35(args.folder)
    engines = {name: LLM(str(args.folder), skip_tokenizer_init=True, max_model_len=4096, enable_prefix_caching=on)
               for name, on in (("snapshots", True), ("off", False))}
    times: dict[str, list[float]] = {name: [] for name in engines}
    tokens: dict[str, int] = {}
    for r in range(args.rounds):
        for name, llm in engines.items():  # the same prompts for both in a round
            seconds, tokens[name] = time_round(llm, random.Random(r), args.shared)
            times[name].append(seconds)
    for name in engines:
        print(f"{name:9s}: S + c first token {statistics.median(times[name]):.3f} s median of "
              f"{[round(t, 3) for t in times[name]]}, {tokens[name]} prompt tokens computed")
    ratios = [b / a for a, b in zip(times["snapshots"], times["off"])]
    print(f"off / snapshots, paired per round: {[round(x, 2) for x in ratios]} (median {statistics.median(ratios):.2f}x)")
    for llm in engines.values():
        llm.engine.close()


if __name__ == "__main__":
    main()
