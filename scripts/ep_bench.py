"""Expert parallelism on loopback: decode tok/s of one process vs a head + one `moeserve ep-worker` on 127.0.0.1, and
the exchange per MoE layer call (activation bytes each way, seconds in the call, seconds the head waited on the
other rank after its own experts were done). LOOPBACK figures: two processes of one machine sharing its cores and
memory bandwidth, no network; they show the exchange's cost, not what a second machine would add.

    PYTHONPATH=. python scripts/ep_bench.py [MODEL] [--tokens 64] [--memory-gb 2] [--threads 1]

MODEL defaults to the bundled demo model. Greedy, batch 1, the same prompt in both runs (the tokens are checked
equal)."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def decode(llm, tokens: int) -> tuple[list[int], float]:  # type: ignore[no-untyped-def]
    """(token ids, decode tok/s: the tokens after the first over the time between the first and the last)."""
    from moeserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(5, 37))}], SamplingParams(temperature=0, max_tokens=8))  # warm-up
    out = llm.generate([{"prompt_token_ids": list(range(5, 37))}], params)[0]
    m = out.metrics
    return out.outputs[0].token_ids, (tokens - 1) / (m["last_token_time"] - m["first_token_time"])


def main() -> int:
    from moeserve import LLM
    from moeserve.engine.llm_engine import demo_model_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=str(demo_model_path()))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--memory-gb", type=float, default=2.0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    common = {"memory_gb": args.memory_gb, "threads": args.threads, "skip_tokenizer_init": True}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    worker = subprocess.Popen([sys.executable, "-m", "moeserve", "ep-worker", args.model, "--head", address,
                               "--memory-gb", str(args.memory_gb), "--threads", str(args.threads)],
                              env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL)
    two = LLM(model=args.model, ep_listen=address, ep_workers=1, **common)
    kernel = two.engine.model.moe_blocks[0].experts
    ids_two, tps_two = decode(two, args.tokens)
    stats = dict(kernel.stats)
    two.engine.close()
    worker.wait(timeout=60)
    one = LLM(model=args.model, **common)
    ids_one, tps_one = decode(one, args.tokens)
    one.engine.close()
    per_op = LLM(model=args.model, decode_step="per_op", **common)  # what expert parallelism steps aside to
    _, tps_per_op = decode(per_op, args.tokens)
    per_op.engine.close()
    calls = stats["calls"]
    load = os.getloadavg()[0]
    print(f"LOOPBACK (127.0.0.1, one machine: {os.cpu_count()} CPUs, load average {load:.1f}); "
          f"{Path(args.model).name}, greedy batch 1, {args.tokens} tokens, threads={args.threads}")
    print(f"decode: 1 rank {tps_one:.1f} tok/s (fused decode step), {tps_per_op:.1f} tok/s (per op, as under expert "
          f"parallelism); 2 ranks {tps_two:.1f} tok/s; tokens equal: {ids_one == ids_two}")
    print(f"per MoE layer call ({calls} calls, prefill included): {stats['bytes_sent'] / calls / 1024:.2f} KiB "
          f"sent, {stats['bytes_received'] / calls / 1024:.2f} KiB received, {1e3 * stats['call_s'] / calls:.3f} ms "
          f"in the call, {1e3 * stats['wait_s'] / calls:.3f} ms waiting on the other rank after the head's own "
          "experts")
    return 0 if ids_one == ids_two else 1


if __name__ == "__main__":
    sys.exit(main())
