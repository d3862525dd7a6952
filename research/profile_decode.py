"""Profile batch-1 greedy decode with torch.profiler and print the ops by self CPU time.

    .venv/bin/python research/profile_decode.py ~/.cache/moeserve/bench/small-bf16 [--steps 9] [--kernels auto]
"""

from __future__ import annotations

import argparse
import time

from torch.profiler import ProfilerActivity, profile

from moeserve import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--steps", type=int, default=9, help="decode steps profiled (after a warm-up run)")
    ap.add_argument("--kernels", default="auto", choices=["auto", "cpp", "torch"])
    ap.add_argument("--rows", type=int, default=25, help="ops shown")
    args = ap.parse_args()
    llm = LLM(args.model, skip_tokenizer_init=True, max_model_len=256, max_num_seqs=8, kernels=args.kernels)
    prompt = [{"prompt_token_ids": list(range(1, 17))}]
    timed = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    llm.generate(prompt, timed)  # warm-up: kernels loaded, buffers allocated
    t0 = time.perf_counter()
    llm.generate(prompt, timed)
    print(f"batch-1 decode: {24 / (time.perf_counter() - t0):.1f} tok/s (24 tokens, prefill included)")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(prompt, SamplingParams(max_tokens=args.steps, temperature=0, ignore_eos=True))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
