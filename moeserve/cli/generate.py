"""`moeserve generate MODEL --prompt TEXT`: one-shot generation, printed to stdout."""

from __future__ import annotations

import argparse
import json
import sys

from moeserve.cli.common import (
    add_engine_arguments,
    add_model_argument,
    add_sampling_arguments,
    engine_settings,
    sampling_params,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate a completion for a prompt")
    add_model_argument(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", help="prompt text (repeatable: prompts run as one batch)")
    src.add_argument("--prompt-token-ids", help="comma-separated token ids (works without a tokenizer)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    p.add_argument("--json", action="store_true", help="print results as JSON lines")
    p.add_argument("--stats", action="store_true", help="print expert-cache and KV-cache statistics, time to first token and "
                   "prefill / decode tokens/s after generating")
    add_sampling_arguments(p)
    add_engine_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    settings = engine_settings(args)  # checked before torch is imported
    from moeserve.engine.llm import LLM

    llm = LLM(**settings.model_dump())
    params = sampling_params(args)
    if args.prompt_token_ids:
        try:
            ids = [int(t) for t in args.prompt_token_ids.split(",") if t.strip()]
        except ValueError:
            print("error: --prompt-token-ids takes comma-separated integers", file=sys.stderr)
            return 2
        outputs = llm.generate({"prompt_token_ids": ids}, params)
    else:
        prompts = args.prompt or ["Once upon a time"]
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
        else:
            outputs = llm.generate(prompts, params)
    for out in outputs:
        for sample in out.outputs:
            if args.json:
                print(json.dumps({"prompt": out.prompt, "text": sample.text, "token_ids": sample.token_ids,
                                  "finish_reason": sample.finish_reason}))
            else:
                print(f"{out.prompt or ''}{sample.text}" if not args.chat else sample.text)
            if args.logprobs is not None and sample.logprobs:
                for step, lp in enumerate(sample.logprobs):
                    chosen = sample.token_ids[step]
                    tops = ", ".join(f"{v.decoded_token!r}:{v.logprob:.3f}" for _, v in
                                     sorted(lp.items(), key=lambda kv: kv[1].rank))
                    print(f"  [{step}] {chosen} {lp[chosen].logprob:.4f} | {tops}")
    if args.stats:
        print(_stats_text(llm))
        print(sequence_memory_text(llm.engine.sequence_memory_stats()))
        print(timing_text(outputs))
    return 0


def timing_text(outputs: list) -> str:  # list[RequestOutput]
    """One line from the engine's own timestamps (arrival, first token, last token of each request): time to first
    token, prefill tokens/s (every prompt token over the span from the first arrival to the last first token) and
    decode tokens/s (the tokens after each sequence's first, over the span from the first first token to the last
    token). A rate is `tokens / seconds` of the printed values."""
    metrics = [out.metrics for out in outputs]
    ttfts = [m["first_token_time"] - m["arrival_time"] for m in metrics]
    prefill_tokens = sum(len(out.prompt_token_ids) for out in outputs)
    prefill_s = max(m["first_token_time"] for m in metrics) - min(m["arrival_time"] for m in metrics)
    decode_tokens = sum(max(len(s.token_ids) - 1, 0) for out in outputs for s in out.outputs)
    decode_s = max(m["last_token_time"] for m in metrics) - min(m["first_token_time"] for m in metrics)
    ttft = f"time to first token {ttfts[0]:.4f} s" if len(ttfts) == 1 else (
        f"time to first token {sum(ttfts) / len(ttfts):.4f} s (mean of {len(ttfts)} requests, max "
        f"{max(ttfts):.4f} s)")
    decode = (f"decode {decode_tokens} tokens in {decode_s:.4f} s = {decode_tokens / decode_s:.1f} tokens/s"
              if decode_tokens and decode_s > 0 else "decode: no token after the first")
    return (f"timing: {ttft}; prefill {prefill_tokens} tokens in {prefill_s:.4f} s = "
            f"{prefill_tokens / prefill_s:.1f} tokens/s; {decode}")


def sequence_memory_text(m: dict[str, float]) -> str:
    """One line: KV blocks, preemptions, prefix-cache hit rate, prefill tokens per step."""
    per_step = m["prefill_tokens"] / m["steps"] if m["steps"] else 0.0
    return (f"kv cache: {int(m['kv_blocks_used'])} of {int(m['kv_blocks_total'])} blocks used, "
            f"{int(m['preemptions'])} preemptions, prefix cache hit rate {m['prefix_hit_rate']:.3f} "
            f"({int(m['prefix_hit_tokens'])} of {int(m['prefix_queried_tokens'])} prompt tokens), "
            f"{per_step:.1f} prefill tokens per step over {int(m['steps'])} steps")


def _stats_text(llm) -> str:  # noqa: ANN001
    from moeserve.experts import store as store_mod

    formatter = getattr(store_mod, "format_stats", None)
    stats = llm.stats
    if formatter is not None:
        return str(formatter(stats))
    return (f"expert cache: hits {stats.hits}, misses {stats.misses}, hit rate {stats.hit_rate:.3f}, "
            f"bytes read {stats.bytes_read}")
