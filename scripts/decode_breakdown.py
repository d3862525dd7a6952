"""Where a batch-1 decode step's time goes, without a profiler's overhead, decode steps only (a 1-token run is
subtracted).

    .venv/bin/python scripts/decode_breakdown.py ~/.cache/moeserve/bench/small-bf16 [--rounds 3] [--tokens 32]
        [--decode-step auto|fused|per_op]

With the fused decode step (the default where it applies) the DecodeStack's own phase timers give each phase's
milliseconds and the GB/s it streamed its weights at (bytes known from the model: GEMV weights, and the units of
the experts the store counted as used). With decode_step=per_op, wall-clock timers around every moeserve C++ op
call and around the Python attention / MoE blocks; what is left is Python, small torch ops and sampling.
"""

from __future__ import annotations

import argparse
import collections
import time
from collections.abc import Callable
from typing import Any

import torch

from moeserve import LLM, SamplingParams
from moeserve.models import layers, moe
from moeserve.models import layers as layers_mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32, help="decode steps timed per round")
    ap.add_argument("--expert-cache-gb", type=float, default=None)
    ap.add_argument("--decode-step", default="auto", choices=("auto", "fused", "per_op"))
    args = ap.parse_args()
    llm = LLM(args.model, skip_tokenizer_init=True, max_model_len=256, max_num_seqs=8,
              expert_cache_gb=args.expert_cache_gb, decode_step=args.decode_step)
    if llm.engine.model.decode_step is not None:
        fused_breakdown(llm, args.rounds, args.tokens)
        return
    seconds: dict[str, float] = collections.defaultdict(float)

    def timed(key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                seconds[key] += time.perf_counter() - t0
        return run

    class TimedOps:  # stands in for torch.ops.moeserve: every op call is timed under its name
        def __init__(self, ops: Any) -> None:
            self._ops = ops

        def __getattr__(self, name: str) -> Any:
            return timed("op " + name, getattr(self._ops, name))

    prompt = [{"prompt_token_ids": list(range(1, 17))}]
    llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
    torch.ops.__dict__["moeserve"] = TimedOps(torch.ops.moeserve)
    layers.Attention.__call__ = timed("block Attention (ops included)", layers.Attention.__call__)  # type: ignore[method-assign]
    moe.MoEBlock.__call__ = timed("block MoEBlock (ops included)", moe.MoEBlock.__call__)  # type: ignore[method-assign]
    for _ in range(args.rounds):
        seconds.clear()
        t0 = time.perf_counter()
        llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))  # prefill + 1 step
        t1 = time.perf_counter()
        first = dict(seconds)
        llm.generate(prompt, SamplingParams(max_tokens=args.tokens + 1, temperature=0, ignore_eos=True))
        t2 = time.perf_counter()
        step = ((t2 - t1) - (t1 - t0)) / args.tokens
        per_step = {k: (v - 2 * first.get(k, 0.0)) / args.tokens for k, v in seconds.items()}
        ops = sum(v for k, v in per_step.items() if k.startswith("op "))
        print(f"decode step {step * 1e3:.2f} ms ({1 / step:.1f} tok/s); all moeserve ops {ops * 1e3:.2f} ms, "
              f"the rest (Python, small torch ops, sampling) {(step - ops) * 1e3:.2f} ms ({100 * (step - ops) / step:.0f}%)")
        for k in sorted(per_step, key=lambda k: -per_step[k]):
            print(f"    {k:40s} {per_step[k] * 1e3:7.3f} ms  {100 * per_step[k] / step:5.1f}%")


def fused_breakdown(llm: LLM, rounds: int, tokens: int) -> None:
    """Per phase of the DecodeStack: ms per decode step, share, and GB/s of the weights it streamed."""
    model = llm.engine.model
    prompt = [{"prompt_token_ids": list(range(1, 17))}]
    llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up; builds the stack
    layers = model.layers
    unit_bytes = model.store.unit_nbytes
    gemv_bytes = {  # weight bytes per decode step of the GEMV phases (biases and scales included)
        "qkv GEMV": sum(layer.attn.qkv.nbytes for layer in layers),
        "o_proj GEMV": sum(layer.attn.o.nbytes for layer in layers),
        "router GEMV": sum(layer.mlp.router.nbytes for layer in layers if isinstance(layer.mlp, moe.MoEBlock)),
        "dense MLP GEMVs": sum(lin.nbytes for layer in layers if isinstance(layer.mlp, layers_mod.DenseMLP)
                               for lin in (layer.mlp.gate, layer.mlp.up, layer.mlp.down)),
    }
    head_seconds = [0.0]
    head = model._head

    class TimedHead:  # the LM head GEMV, timed (it runs outside the stack)
        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            t0 = time.perf_counter()
            try:
                return head(x)
            finally:
                head_seconds[0] += time.perf_counter() - t0

    if head is not None:
        model._head = TimedHead()  # type: ignore[assignment]
    for _ in range(rounds):
        hits0 = model.store.stats.hits + model.store.stats.misses  # experts computed (offloaded: misses too)
        head_seconds[0] = 0.0
        model.decode_step.stack(llm.engine.kv).set_profiling(True)
        t0 = time.perf_counter()
        llm.generate(prompt, SamplingParams(max_tokens=tokens + 1, temperature=0, ignore_eos=True))
        t1 = time.perf_counter()
        head_step = head_seconds[0] / (tokens + 1)
        names, secs = model.decode_step.stack(llm.engine.kv).profile()
        model.decode_step.stack(llm.engine.kv).set_profiling(False)
        hits1 = model.store.stats.hits + model.store.stats.misses
        t2 = time.perf_counter()
        llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))  # prefill + sampling
        t3 = time.perf_counter()
        step = ((t1 - t0) - (t3 - t2)) / tokens
        # experts the timed run's decode steps used: its hits less those of a prefill alone
        steps_hits = (hits1 - hits0) - (model.store.stats.hits + model.store.stats.misses - hits1)
        per_step = {n: v / tokens for n, v in zip(names, secs)}
        inside = sum(per_step.values())
        print(f"decode step {step * 1e3:.2f} ms ({1 / step:.1f} tok/s); inside the DecodeStack {inside * 1e3:.2f} ms, "
              f"LM head {head_step * 1e3:.2f} ms "
              + (f"({head.nbytes / head_step / 1e9:.1f} GB/s)" if head is not None and head_step > 0 else "")
              + f", the rest (embedding, sampling, engine{'' if model.store.resident else ', the store between layers'}) "
              f"{(step - inside - head_step) * 1e3:.2f} ms")
        expert_bytes = steps_hits * unit_bytes / tokens
        for name in sorted(per_step, key=lambda k: -per_step[k]):
            ms = per_step[name] * 1e3
            nbytes = expert_bytes if name.startswith("experts") else gemv_bytes.get(name)
            rate = f"  {nbytes / per_step[name] / 1e9:5.1f} GB/s" if nbytes and per_step[name] > 0 else ""
            print(f"    {name:42s} {ms:7.3f} ms  {100 * per_step[name] / step:5.1f}%{rate}")


if __name__ == "__main__":
    main()
