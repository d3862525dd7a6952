"""Expert admission control on the bundled demo model (real trained routing): the engine's store with
expert_admission=always vs policy, same prompts, same sampled tokens, same cache; hit rate and bytes read per
token from the store's own counters, then the recorded trace replayed through `simulate(admission=...)` as a check.

    .venv/bin/python research/admission_demo.py --experts 12 --batch 8 --tokens 128 --policy lfru

Counts are exact (the tokens do not depend on the placement, so both runs route the same); tokens/s is printed
but depends on the machine's load.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from moeserve import LLM, SamplingParams
from moeserve.bench.simulate import calls_from_steps, simulate
from moeserve.experts.traces.moetrace import read_trace

PROMPTS = [
    "Once upon a time", "It is a truth universally acknowledged, that", "Mr. Darcy walked into the room and",
    "The letter from Bath arrived", "Emma could not help thinking", "Her sister said nothing, but",
    "The ball at Netherfield", "Captain Wentworth", "When the carriage stopped at the door,",
    "Lady Catherine was", "In the morning the weather", "Anne Elliot had been",
]


def run(admission: str, args: argparse.Namespace, trace: Path) -> tuple[str, list[list[int]]]:
    probe = LLM(dtype="bfloat16", threads=1, expert_cache_gb=1e-6)  # the unit size of this dtype
    unit = probe.engine.model.store.unit_nbytes
    probe.engine.close()
    llm = LLM(dtype="bfloat16", threads=1, max_num_seqs=args.batch, expert_cache_gb=args.experts * unit / 2**30,
              cache_policy=args.policy, expert_admission=admission, record_trace=str(trace))
    store = llm.engine.model.store
    params = SamplingParams(temperature=0.8, max_tokens=args.tokens, ignore_eos=True, seed=7)
    t0 = time.perf_counter()
    outs = llm.generate(PROMPTS[: args.batch], params)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    s = store.stats
    line = (f"{admission:>6}: {store.capacity} of {store.total_experts} experts cached, hit rate {s.hit_rate:.3f} "
            f"({s.hits} hits, {s.misses} misses of which {s.bypassed} bypassed), read "
            f"{s.bytes_read / 2**20:.1f} MiB = {s.bytes_read / tokens / 2**10:.0f} KiB/token, "
            f"{tokens / seconds:.1f} tok/s (load-dependent), compute thread waited {s.wait_seconds:.2f} s on reads "
            f"({s.read_seconds:.2f} s reading)")
    llm.engine.close()
    return line, [o.outputs[0].token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=12, help="experts in the cache (the demo has 4 x 8 = 32)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--policy", default="lfru")
    ap.add_argument("--order", default="always,policy", help="the runs, in this order (alternate to see the load)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        lines, outputs = [], []
        for admission in args.order.split(","):
            trace = Path(tmp) / f"{admission}.trace"
            line, tokens = run(admission, args, trace)
            steps = calls_from_steps(read_trace(trace))
            sim = simulate(steps, args.policy, args.experts, admission=admission == "policy")
            lines.append(f"{line}\n        simulate(admission={admission == 'policy'}) on its trace: hit rate "
                         f"{sim.hit_rate:.3f} ({sim.hits} hits, {sim.misses} misses, {sim.bypassed} bypassed)")
            outputs.append(tokens)
    print(f"demo model, bf16, batch {args.batch}, {args.tokens} tokens each, policy {args.policy}")
    print("\n".join(lines))
    print("same tokens:", all(out == outputs[0] for out in outputs))


if __name__ == "__main__":
    main()
