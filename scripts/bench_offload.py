"""Decode speed and hit rates of the tiered expert store on a synthetic Qwen3-MoE larger than its cache.

    .venv/bin/python scripts/bench_offload.py --model /tmp/synth [--cache-fraction 0.25] [--tokens 32]

Builds the synthetic checkpoint of tests/test_offload_rss.py in --model if it is not there (2.25 GiB of experts,
streamed to disk). Then, with the expert cache at --cache-fraction of all experts, prints (does not assert):
decode tokens/s with prefetch off vs on (policy lfru), and the hit rate of each policy (prefetch off). The static
policy pins from a trace recorded on a different prompt first. Figures go into docs/expert-store.md.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moeserve.bench.checkpoints import write_synthetic_checkpoint  # noqa: E402
from moeserve.engine.llm import LLM  # noqa: E402
from moeserve.engine.sampling_params import SamplingParams  # noqa: E402

PROMPT = [5, 17, 300, 42, 9, 1000, 77, 8, 123, 456, 789, 1011, 12, 13, 14, 15]
TRACE_PROMPT = [900, 31, 2, 444, 87, 6, 3000, 71]


def run(model: str, cache_gb: float, tokens: int, threads: int, **settings) -> dict:
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
               mib_per_token=stats.bytes_read / 2**20 / len(times), capacity=engine.model.store.capacity,
               total=engine.model.store.total_experts)
    engine.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="folder of the synthetic checkpoint (built if missing)")
    ap.add_argument("--cache-fraction", type=float, default=0.25)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    folder = Path(args.model)
    if not (folder / "config.json").exists():
        print(f"building the synthetic checkpoint in {folder} ...", flush=True)
        write_synthetic_checkpoint(folder)
    probe = LLM(str(folder), skip_tokenizer_init=True, dtype="bfloat16", expert_cache_gb=0, max_model_len=256,
                max_num_seqs=1, threads=args.threads)
    unit, total = probe.engine.model.store.unit_nbytes, probe.engine.model.store.total_experts
    probe.engine.close()
    cache_gb = int(total * args.cache_fraction) * unit / 2**30
    print(f"{total} experts of {unit / 2**20:.2f} MiB; cache {int(total * args.cache_fraction)} experts "
          f"({cache_gb:.3f} GiB); {args.tokens} tokens, batch 1, {args.threads} threads")

    for prefetch in (False, True):
        r = run(str(folder), cache_gb, args.tokens, args.threads, cache_policy="lfru", prefetch=prefetch)
        acc = "n/a" if r["accuracy"] is None else f"{100 * r['accuracy']:.0f}%"
        print(f"lfru prefetch {'on ' if prefetch else 'off'}: decode {r['tok_s']:.2f} tok/s, hit rate "
              f"{100 * r['hit_rate']:.1f}%, read {r['mib_per_token']:.0f} MiB/token, prefetch accuracy {acc}")

    trace = folder.parent / (folder.name + "-bench.trace")
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="bfloat16", threads=args.threads, expert_cache_gb=cache_gb,
              max_model_len=256, max_num_seqs=1, prefetch=False, record_trace=str(trace))
    llm.generate({"prompt_token_ids": TRACE_PROMPT}, SamplingParams(temperature=0, max_tokens=args.tokens,
                                                                    ignore_eos=True))
    llm.engine.close()
    for policy in ("lru", "lfu", "lfru", "static"):
        extra = {"cache_trace": str(trace)} if policy == "static" else {}
        r = run(str(folder), cache_gb, args.tokens, args.threads, cache_policy=policy, prefetch=False, **extra)
        print(f"{policy:>6} (prefetch off): hit rate {100 * r['hit_rate']:.1f}%, decode {r['tok_s']:.2f} tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
