"""What batch invariance costs: batch_invariant on vs off, alternated round by round in one process.

    .venv/bin/python scripts/bench_batch_invariance.py [--model gpt-oss-20b] [--rounds 5] [--tokens 32]

Builds (once, under /tmp) a checkpoint at a published model's real dimensions truncated to 2 layers
(tests/real_dims.py), loads it twice (batch_invariant=True / False, everything else default), and times, in
alternating order each round: decode of 1 sequence, decode of 8 together, and a 256-token prefill. Prints the median
tokens/s of each and the ratio on/off. gpt-oss is the default model because its expert math runs through torch
(the only place where invariance adds work on the default path: rows in blocks of 16); for the SwiGLU models the
C++ ops were per-row already and the difference is attention in prefill (per-token C++ op vs torch's SDPA).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moeserve import LLM, SamplingParams  # noqa: E402
from moeserve.bench.real_dims import (  # noqa: E402
    REAL_DIMS,
    VOCAB,
    write_gpt_oss_mxfp4,  # noqa: E402
    write_real_dims,
)


def timed(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    """Tokens per second: generated tokens (decode) or prompt tokens (max_tokens=1: prefill)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    dt = time.perf_counter() - t0
    n = sum(len(p) for p in prompts) if max_tokens == 1 else sum(len(o.outputs[0].token_ids) for o in outs)
    return n / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-oss-20b", choices=list(REAL_DIMS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--mxfp4", action="store_true", help="gpt-oss only: experts stored in MXFP4 (dequantized per call)")
    args = ap.parse_args()
    folder = Path("/tmp/moeserve-real-dims") / args.model
    if not (folder / "config.json").exists():
        write_real_dims(folder, args.model)
    if args.mxfp4:
        src, folder = folder, folder.with_name(args.model + "-mxfp4")
        if not (folder / "config.json").exists():
            write_gpt_oss_mxfp4(src, folder)
    engines = {on: LLM(str(folder), skip_tokenizer_init=True, batch_invariant=on, max_num_seqs=8, max_model_len=512)
               for on in (True, False)}
    rng = random.Random(0)
    cases = {
        "decode-b1": ([[rng.randrange(VOCAB) for _ in range(16)]], args.tokens),
        "decode-b8": ([[rng.randrange(VOCAB) for _ in range(16)] for _ in range(8)], args.tokens),
        "prefill-256": ([[rng.randrange(VOCAB) for _ in range(256)]], 1),
    }
    for llm in engines.values():  # warm-up
        timed(llm, [[1, 2, 3]], 2)
    results: dict[tuple[str, bool], list[float]] = {}
    for r in range(args.rounds):
        order = (True, False) if r % 2 == 0 else (False, True)
        for case, (prompts, n) in cases.items():
            for on in order:
                results.setdefault((case, on), []).append(timed(engines[on], prompts, n))
    print(f"{folder.name} (2 layers, real dims), {args.rounds} rounds alternated; median tokens/s")
    for case in cases:
        on, off = (statistics.median(results[(case, v)]) for v in (True, False))
        ratios = [a / b for a, b in zip(results[(case, True)], results[(case, False)])]
        print(f"  {case:12s} invariant {on:8.1f}  variant {off:8.1f}  ratio {on / off:.3f} "
              f"(per round {min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
