"""Decode speed and hit rates of the tiered expert store on a synthetic Qwen3-MoE larger than its cache.

Builds the synthetic checkpoint of moeserve/bench/checkpoints.py in --model if it is not there (8 layers x 64
experts: 2.25 GiB of experts, streamed to disk; --layers and --experts make it smaller). Then, with the expert cache
at --cache-fraction of all experts, prints: decode tokens/s with prefetch off vs on (policy lfru), and the hit rate
of each policy (prefetch off). The static policy pins from a trace recorded on a different prompt first.

    moeserve bench offload --model /tmp/synth --cache-fraction 0.25 --tokens 32
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Any

from moeserve.bench.variants import add_parser, require_positive

PROMPT = [5, 17, 300, 42, 9, 1000, 77, 8, 123, 456, 789, 1011, 12, 13, 14, 15]
TRACE_PROMPT = [900, 31, 2, 444, 87, 6, 3000, 71]
POLICIES = ("lru", "lfu", "lfru", "static")


def register(sub: argparse._SubParsersAction) -> None:
    p = add_parser(sub, "offload", __doc__)
    p.add_argument("--model", type=Path, default=None,
                   help="folder of the synthetic checkpoint, built there if missing (default: "
                        "~/.cache/moeserve/bench/synthetic-qwen3-moe-LxE)")
    p.add_argument("--layers", type=int, default=8, help="decoder layers of a checkpoint built here (default 8)")
    p.add_argument("--experts", type=int, default=64, help="experts per layer of a checkpoint built here (default 64)")
    p.add_argument("--cache-fraction", type=float, default=0.25, help="expert cache, a fraction of all experts")
    p.add_argument("--tokens", type=int, default=32, help="decode steps timed per run")
    p.add_argument("--threads", type=int, default=2, help="compute threads (default 2)")
    p.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated, of: {', '.join(POLICIES)}")
    p.set_defaults(func=run)


def _decode(model: str, cache_gb: float, tokens: int, threads: int, **settings: Any) -> dict[str, Any]:
    """One engine, one greedy batch-1 decode of PROMPT: decode tokens/s (prefill step excluded) and store counters."""
    from moeserve.engine.llm import LLM
    from moeserve.engine.sampling_params import SamplingParams

    llm = LLM(model, skip_tokenizer_init=True, dtype="bfloat16", threads=threads, expert_cache_gb=cache_gb,
              max_model_len=256, max_num_seqs=1, **settings)
    engine = llm.engine
    times: list[float] = []
    engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
        times.append(time.perf_counter())
    stats = engine.model.store.stats
    decode_s = times[-1] - times[0]  # after the prefill step: tokens - 1 decode steps
    out = dict(tok_s=(len(times) - 1) / decode_s, hit_rate=stats.hit_rate, accuracy=stats.prefetch_accuracy,
               mib_per_token=stats.bytes_read / 2**20 / len(times))
    engine.close()
    return out


def _cache_gb(folder: Path, fraction: float, threads: int) -> float:
    """The cache of `fraction` of the checkpoint's experts, in GiB (whole experts), as read from a probe engine."""
    from moeserve.engine.llm import LLM

    probe = LLM(str(folder), skip_tokenizer_init=True, dtype="bfloat16", expert_cache_gb=0, max_model_len=256,
                max_num_seqs=1, threads=threads)
    unit, total = probe.engine.model.store.unit_nbytes, probe.engine.model.store.total_experts
    probe.engine.close()
    count = max(1, int(total * fraction))
    print(f"{total} experts of {unit / 2**20:.2f} MiB; cache {count} experts ({count * unit / 2**30:.3f} GiB)")
    return count * unit / 2**30


def _policies(text: str) -> list[str]:
    from moeserve.config import did_you_mean
    from moeserve.errors import ConfigError

    names = [p.strip() for p in text.split(",") if p.strip()]
    for name in names:
        if name not in POLICIES:
            raise ConfigError(f"--policies: unknown policy {name!r}{did_you_mean(name, list(POLICIES))}")
    return names


def run(args: argparse.Namespace) -> int:
    from moeserve.bench.checkpoints import SYNTH_CONFIG, write_synthetic_checkpoint
    from moeserve.bench.synth import default_cache_dir
    from moeserve.engine.llm import LLM
    from moeserve.engine.sampling_params import SamplingParams

    require_positive(layers=args.layers, experts=args.experts, tokens=args.tokens, threads=args.threads,
                     cache_fraction=args.cache_fraction)
    policies = _policies(args.policies)
    logging.getLogger("moeserve").setLevel(logging.WARNING)
    folder = args.model or default_cache_dir() / f"synthetic-qwen3-moe-{args.layers}x{args.experts}"
    if not (folder / "config.json").exists():
        print(f"building the synthetic checkpoint in {folder} ...", flush=True)
        write_synthetic_checkpoint(folder, {**SYNTH_CONFIG, "num_hidden_layers": args.layers,
                                            "num_experts": args.experts})
    cache_gb = _cache_gb(folder, args.cache_fraction, args.threads)
    print(f"{args.tokens} tokens, batch 1, {args.threads} threads")
    for prefetch in (False, True):
        r = _decode(str(folder), cache_gb, args.tokens, args.threads, cache_policy="lfru", prefetch=prefetch)
        acc = "n/a" if r["accuracy"] is None else f"{100 * r['accuracy']:.0f}%"
        print(f"lfru prefetch {'on ' if prefetch else 'off'}: decode {r['tok_s']:.2f} tok/s, hit rate "
              f"{100 * r['hit_rate']:.1f}%, read {r['mib_per_token']:.0f} MiB/token, prefetch accuracy {acc}")
    trace = folder.parent / (folder.name + "-bench.trace")
    if "static" in policies:  # static pins the experts of a trace recorded on another prompt
        llm = LLM(str(folder), skip_tokenizer_init=True, dtype="bfloat16", threads=args.threads,
                  expert_cache_gb=cache_gb, max_model_len=256, max_num_seqs=1, prefetch=False, record_trace=str(trace))
        llm.generate({"prompt_token_ids": TRACE_PROMPT},
                     SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True))
        llm.engine.close()
    for policy in policies:
        extra = {"cache_trace": str(trace)} if policy == "static" else {}
        r = _decode(str(folder), cache_gb, args.tokens, args.threads, cache_policy=policy, prefetch=False, **extra)
        print(f"{policy:>6} (prefetch off): hit rate {100 * r['hit_rate']:.1f}%, decode {r['tok_s']:.2f} tok/s")
    return 0
