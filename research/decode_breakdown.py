"""Where a batch-1 decode step's time goes, without a profiler's overhead, decode steps only (a 1-token run is
subtracted). Any architecture: attention, Gated DeltaNet, MLA and Mamba-2 layers, dense and MoE FFNs.

    .venv/bin/python research/decode_breakdown.py --shape hybrid [--rounds 3] [--tokens 32] [--threads N]
    .venv/bin/python research/decode_breakdown.py ~/.cache/moeserve/bench/small-bf16 [--decode-step auto|fused|per_op]
    .venv/bin/python research/decode_breakdown.py --shape small --quantization int4 --threads 1

`--shape NAME`: a bench shape's synthetic checkpoint (`moeserve bench` builds the same one, cached).

With the fused decode step (the default where it applies) the DecodeStack's own phase timers give each phase's
milliseconds and the GB/s it streamed its weights at (bytes known from the model: GEMV weights, and the units of
the experts the store counted as used). A phase adds every layer kind's share (the mixers' input projections all
count as "qkv GEMV", their cores as "attention"); the rows under each phase give each layer kind's weight bytes. With
decode_step=per_op (or a model the fused step does not take), wall-clock timers around every moeserve C++ op call
and around each layer kind's part (one row per token-mixer and FFN class, nested parts counted in their caller);
what is left is Python, small torch ops and sampling.
"""

from __future__ import annotations

import argparse
import collections
import time
from collections.abc import Callable
from typing import Any

import torch

from moeserve import LLM, SamplingParams
from moeserve.models.experts.moe import MoEBlock
from moeserve.models.layers.linear import Linear

PROMPT = [{"prompt_token_ids": list(range(1, 17))}]
OUT_PROJECTIONS = ("o", "out_proj")  # a token mixer's output projection: the "o_proj GEMV" phase; the rest "qkv GEMV"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="a model folder (or --shape)")
    ap.add_argument("--shape", help="a bench shape (tiny, small, large, hybrid, mla, mamba-hybrid): its checkpoint")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32, help="decode steps timed per round")
    ap.add_argument("--expert-cache-gb", type=float, default=None)
    ap.add_argument("--decode-step", default="auto", choices=("auto", "fused", "per_op"))
    ap.add_argument("--threads", type=int, default=None, help="default: every usable core (1 on a busy machine)")
    ap.add_argument("--quantization", default="none", help="none (the default: the checkpoint's weights), int8 or int4")
    args = ap.parse_args()
    if (args.model is None) == (args.shape is None):
        ap.error("give a model folder or --shape, not both")
    folder = args.model or str(shape_checkpoint(args.shape))
    llm = LLM(folder, skip_tokenizer_init=True, max_model_len=256, max_num_seqs=8,
              expert_cache_gb=args.expert_cache_gb, decode_step=args.decode_step, threads=args.threads,
              quantization=args.quantization)
    model = llm.engine.model
    print(f"{folder}: {layer_kinds(model)}; decode step: {llm.engine.choices['decode step']}")
    if model.decode_step is not None:
        fused_breakdown(llm, args.rounds, args.tokens)
    else:
        per_op_breakdown(llm, args.rounds, args.tokens)


def shape_checkpoint(name: str) -> Any:
    from moeserve.bench.shapes import get_shape
    from moeserve.bench.synth import default_cache_dir, ensure_checkpoint

    return ensure_checkpoint(get_shape(name), default_cache_dir())


def layer_kinds(model: Any) -> str:
    """'GatedDeltaNet+MoEBlock x3, Attention+MoEBlock x1': each (mixer, FFN) kind and its layer count."""
    kinds = collections.Counter(f"{type(layer.attn).__name__}+{type(layer.mlp).__name__}" for layer in model.layers)
    return ", ".join(f"{kind} x{n}" for kind, n in kinds.items())


def linears(part: Any) -> dict[str, Linear]:
    return {name: v for name, v in vars(part).items() if isinstance(v, Linear)}


def phase_bytes(model: Any) -> dict[str, dict[str, int]]:
    """Weight bytes a decode step streams in each GEMV phase of the DecodeStack, by layer kind (class name)."""
    out: dict[str, dict[str, int]] = collections.defaultdict(lambda: collections.defaultdict(int))
    for layer in model.layers:
        mixer, ffn = layer.attn, layer.mlp
        for name, lin in linears(mixer).items():
            out["o_proj GEMV" if name in OUT_PROJECTIONS else "qkv GEMV"][type(mixer).__name__] += lin.nbytes
        if isinstance(ffn, MoEBlock):
            out["router GEMV"]["MoEBlock"] += ffn.router.nbytes
            shared = [*linears(ffn.shared).values()] if ffn.shared is not None else []
            shared += [ffn.shared_gate] if ffn.shared_gate is not None else []
            if shared:
                out["shared expert"]["MoEBlock"] += sum(lin.nbytes for lin in shared)
        else:
            out["dense MLP GEMVs"][type(ffn).__name__] += sum(lin.nbytes for lin in linears(ffn).values())
    return out


def fused_breakdown(llm: LLM, rounds: int, tokens: int) -> None:
    """Per phase of the DecodeStack: ms per decode step, share, and GB/s of the weights it streamed."""
    model = llm.engine.model
    llm.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up; builds the stack
    gemv_bytes = phase_bytes(model)
    mixer_counts = collections.Counter(type(layer.attn).__name__ for layer in model.layers)
    mixers = ", ".join(f"{kind} x{n}" for kind, n in mixer_counts.items() if kind != "NoMixer")
    head, head_seconds = model._head, [0.0]
    if head is not None:  # the LM head GEMV, timed (it runs outside the stack)
        model._head = _timed(head, head_seconds)
    stats = model.store.stats
    for _ in range(rounds):
        used0 = stats.hits + stats.misses  # experts computed (offloaded: misses too)
        head_seconds[0] = 0.0
        stack = model.decode_step.stack(llm.engine.kv)
        stack.set_profiling(True)
        t0 = time.perf_counter()
        llm.generate(PROMPT, SamplingParams(max_tokens=tokens + 1, temperature=0, ignore_eos=True))
        t1 = time.perf_counter()
        head_step = head_seconds[0] / (tokens + 1)
        names, secs = stack.profile()
        stack.set_profiling(False)
        used1 = stats.hits + stats.misses
        t2 = time.perf_counter()
        llm.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))  # prefill + sampling
        t3 = time.perf_counter()
        step = ((t1 - t0) - (t3 - t2)) / tokens
        # experts the timed run's decode steps used: its hits less those of a prefill alone
        expert_bytes = ((used1 - used0) - (stats.hits + stats.misses - used1)) * model.store.unit_nbytes / tokens
        per_step = {n: v / tokens for n, v in zip(names, secs)}
        inside = sum(per_step.values())
        rest = "embedding, sampling, engine" + ("" if model.store.resident else ", the store between layers")
        head_rate = f" ({head.nbytes / head_step / 1e9:.1f} GB/s)" if head is not None and head_step > 0 else ""
        print(f"decode step {step * 1e3:.2f} ms ({1 / step:.1f} tok/s); inside the DecodeStack {inside * 1e3:.2f} ms, "
              f"LM head {head_step * 1e3:.2f} ms{head_rate}, the rest ({rest}) "
              f"{(step - inside - head_step) * 1e3:.2f} ms")
        for name in sorted(per_step, key=lambda k: -per_step[k]):
            kinds = gemv_bytes.get(name, {})
            nbytes = expert_bytes if name.startswith("experts") else sum(kinds.values())
            rate = f"  {nbytes / per_step[name] / 1e9:5.1f} GB/s" if nbytes and per_step[name] > 0 else ""
            print(f"    {name:42s} {per_step[name] * 1e3:7.3f} ms  {100 * per_step[name] / step:5.1f}%{rate}")
            for kind, n in kinds.items() if len(kinds) > 1 else ():
                print(f"        {kind:38s} {n / 2**20:9.1f} MiB of weights")
            if name.endswith("attention") and len(mixer_counts) > 1:
                print(f"        {mixers} (every mixer's core: not split by kind)")


def _timed(fn: Callable[..., Any], seconds: list[float]) -> Callable[..., Any]:
    def run(*a: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a)
        finally:
            seconds[0] += time.perf_counter() - t0
    return run


def per_op_breakdown(llm: LLM, rounds: int, tokens: int) -> None:
    """Wall-clock per moeserve op and per layer kind's part (ops included), per decode step."""
    seconds: dict[str, float] = collections.defaultdict(float)
    depth = [0]  # parts nested in a timed part (a shared expert's MLP in its MoE block) count in their caller

    def timed(key: str, fn: Callable[..., Any], nested: bool = True) -> Callable[..., Any]:
        def run(*a: Any, **k: Any) -> Any:
            if not nested and depth[0]:
                return fn(*a, **k)
            depth[0] += not nested
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                seconds[key] += time.perf_counter() - t0
                depth[0] -= not nested
        return run

    class TimedOps:  # stands in for torch.ops.moeserve: every op call is timed under its name
        def __init__(self, ops: Any) -> None:
            self._ops = ops

        def __getattr__(self, name: str) -> Any:
            return timed("op " + name, getattr(self._ops, name))

    model = llm.engine.model
    llm.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
    torch.ops.__dict__["moeserve"] = TimedOps(torch.ops.moeserve)
    counts = collections.Counter(type(part) for layer in model.layers for part in (layer.attn, layer.mlp))
    for cls, n in counts.items():  # each layer kind's part, timed under its class name
        cls.__call__ = timed(f"layers {cls.__name__} x{n} (ops included)", cls.__call__, nested=False)
    for _ in range(rounds):
        seconds.clear()
        t0 = time.perf_counter()
        llm.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))  # prefill + 1 step
        t1 = time.perf_counter()
        first = dict(seconds)
        llm.generate(PROMPT, SamplingParams(max_tokens=tokens + 1, temperature=0, ignore_eos=True))
        t2 = time.perf_counter()
        step = ((t2 - t1) - (t1 - t0)) / tokens
        per_step = {k: (v - 2 * first.get(k, 0.0)) / tokens for k, v in seconds.items()}
        ops = sum(v for k, v in per_step.items() if k.startswith("op "))
        print(f"decode step {step * 1e3:.2f} ms ({1 / step:.1f} tok/s); all moeserve ops {ops * 1e3:.2f} ms, "
              f"the rest (Python, small torch ops, sampling) {(step - ops) * 1e3:.2f} ms "
              f"({100 * (step - ops) / step:.0f}%)")
        for k in sorted(per_step, key=lambda k: (not k.startswith("layers"), -per_step[k])):
            if per_step[k] <= 0:  # an op of the prefill only (its two runs subtracted)
                continue
            print(f"    {k:52s} {per_step[k] * 1e3:7.3f} ms  {100 * per_step[k] / step:5.1f}%")


if __name__ == "__main__":
    main()
