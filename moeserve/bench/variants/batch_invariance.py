"""What batch invariance costs: batch_invariant on vs off, alternated round by round in one process.

Builds (once, in the cache) a checkpoint at a published model's real dimensions truncated to 2 layers
(moeserve/bench/real_dims.py; --model takes any checkpoint instead), loads it twice (batch_invariant=True / False,
everything else default), and times, in alternating order each round: decode of 1 sequence, decode of 8 together,
and a 256-token prefill. Prints the median tokens/s of each and the ratio on/off. gpt-oss is the default because its
expert math runs through torch (the only place where invariance adds work on the default path: rows in blocks of
16); for the SwiGLU models the C++ ops were per-row already and the difference is attention in prefill (per-token
C++ op vs torch's SDPA).

    moeserve bench batch-invariance --dims gpt-oss-20b --repeats 5 --tokens 32
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from moeserve.bench.variants import add_parser, add_repeats_flag, require_positive

PREFILL = 256  # tokens of the prefill case


def register(sub: argparse._SubParsersAction) -> None:
    from moeserve.bench.real_dims import REAL_DIMS

    p = add_parser(sub, "batch-invariance", __doc__)
    p.add_argument("--dims", default="gpt-oss-20b", choices=list(REAL_DIMS),
                   help="the published model whose dimensions the checkpoint has (default gpt-oss-20b)")
    p.add_argument("--model", type=Path, default=None, help="a checkpoint folder instead of --dims")
    p.add_argument("--mxfp4", action="store_true", help="gpt-oss only: experts stored in MXFP4 (dequantized per call)")
    p.add_argument("--cache-dir", type=Path, default=None, help="where --dims checkpoints are cached "
                   "(default ~/.cache/moeserve/bench)")
    add_repeats_flag(p, 5)
    p.add_argument("--tokens", type=int, default=32, help="decode steps per sequence (default 32)")
    p.set_defaults(func=run)


def _timed(llm: Any, prompts: list[list[int]], max_tokens: int) -> float:
    """Tokens per second: generated tokens (decode) or prompt tokens (max_tokens=1: prefill)."""
    from moeserve.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    dt = time.perf_counter() - t0
    n = sum(len(p) for p in prompts) if max_tokens == 1 else sum(len(o.outputs[0].token_ids) for o in outs)
    return n / dt


def _checkpoint(args: argparse.Namespace) -> Path:
    """--model, or the --dims checkpoint (and its MXFP4 copy with --mxfp4), written into the cache when absent."""
    from moeserve.bench.real_dims import write_gpt_oss_mxfp4, write_real_dims
    from moeserve.bench.synth import default_cache_dir
    from moeserve.errors import ConfigError

    if args.model is not None:
        if args.mxfp4:
            raise ConfigError("--mxfp4 rewrites a --dims checkpoint; give --model or --mxfp4, not both")
        return Path(args.model)
    folder = (args.cache_dir or default_cache_dir()) / "real-dims" / args.dims
    if not (folder / "config.json").exists():
        write_real_dims(folder, args.dims)
    if not args.mxfp4:
        return folder
    if not args.dims.startswith("gpt-oss"):
        raise ConfigError(f"--mxfp4 is gpt-oss's layout; --dims {args.dims} has no MXFP4 form")
    src, folder = folder, folder.with_name(args.dims + "-mxfp4")
    if not (folder / "config.json").exists():
        write_gpt_oss_mxfp4(src, folder)
    return folder


def run(args: argparse.Namespace) -> int:
    from moeserve.engine.llm import LLM

    require_positive(repeats=args.repeats, tokens=args.tokens)
    folder = _checkpoint(args)
    vocab = json.loads((folder / "config.json").read_text()).get("vocab_size", 300)
    engines = {on: LLM(str(folder), skip_tokenizer_init=True, batch_invariant=on, max_num_seqs=8,
                       max_model_len=PREFILL + args.tokens + 16) for on in (True, False)}
    rng = random.Random(0)
    cases = {
        "decode-b1": ([[rng.randrange(vocab) for _ in range(16)]], args.tokens),
        "decode-b8": ([[rng.randrange(vocab) for _ in range(16)] for _ in range(8)], args.tokens),
        f"prefill-{PREFILL}": ([[rng.randrange(vocab) for _ in range(PREFILL)]], 1),
    }
    for llm in engines.values():  # warm-up
        _timed(llm, [[1, 2, 3]], 2)
    results: dict[tuple[str, bool], list[float]] = {}
    for r in range(args.repeats):
        order = (True, False) if r % 2 == 0 else (False, True)
        for case, (prompts, n) in cases.items():
            for on in order:
                results.setdefault((case, on), []).append(_timed(engines[on], prompts, n))
    print(f"{folder.name}, {args.repeats} rounds alternated; median tokens/s")
    for case in cases:
        inv, var = (statistics.median(results[(case, v)]) for v in (True, False))
        ratios = [a / b for a, b in zip(results[(case, True)], results[(case, False)])]
        print(f"  {case:12s} invariant {inv:8.1f}  variant {var:8.1f}  ratio {inv / var:.3f} "
              f"(per round {min(ratios):.3f}-{max(ratios):.3f})")
    for llm in engines.values():
        llm.engine.close()
    return 0
