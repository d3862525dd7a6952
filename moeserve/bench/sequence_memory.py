"""The figures of `moeserve bench sequence-memory` (moeserve/bench/variants/sequence_memory.py): the paged KV
cache, chunked prefill and prefix caching, each measured on a bench shape's synthetic model through the engine's own
step loop. Compared configurations alternate (A B A B), each figure is the median of its runs; each figure function
prints its runs and appends one (figure, result) row for the report.
"""

from __future__ import annotations

import dataclasses
import gc
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any, cast

from moeserve.bench.ceilings import resident_step_bytes
from moeserve.bench.runner import make_prompts
from moeserve.bench.shapes import SHAPES, BenchShape
from moeserve.memory import probes
from moeserve.memory.probes import ram_copy_bandwidth

LONGCTX = BenchShape("longctx", hidden_size=1024, num_layers=8, num_experts=32, moe_intermediate_size=512, top_k=4,
                     vocab_size=32000, num_heads=8, num_kv_heads=2, head_dim=64, max_position_embeddings=40960,
                     purpose="long contexts: the small shape's MoE in 8 layers, 2 KV heads (4 KiB KV per token)")
TINYCTX = dataclasses.replace(cast(BenchShape, SHAPES["tiny"]), name="tiny-ctx4k", max_position_embeddings=4096,
                              purpose="smoke runs of moeserve bench sequence-memory")


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The sizes of one run (FULL or QUICK), per figure; token counts unless named otherwise."""

    shape: BenchShape
    long: int  # item 1
    short: int
    chunk: int  # max_num_batched_tokens of the chunked engine
    ttft_pairs: int
    system: int  # item 2
    suffix: int
    prefix_pairs: int
    contexts: tuple[int, ...]  # item 3
    decode_steps: int
    segments: int
    mix_requests: int  # item 4
    mix_concurrent: int
    mix_prompt: tuple[int, int]
    mix_output: tuple[int, int]
    slot_max_model_len: int
    commits_shape: str  # item 5
    commits_tokens: int
    commits_repeats: int
    kv_cache_gb: float | None

    @property
    def unchunked(self) -> int:
        return self.long + 2 * self.short  # >= long + short: the whole prompt (and the short one) in one step


FULL = Sizes(LONGCTX, long=16384, short=32, chunk=2048, ttft_pairs=4, system=2048, suffix=64, prefix_pairs=5,
             contexts=(1024, 8192, 32768), decode_steps=32, segments=5, mix_requests=24, mix_concurrent=8,
             mix_prompt=(50, 3000), mix_output=(20, 200), slot_max_model_len=4096, commits_shape="small",
             commits_tokens=64, commits_repeats=9, kv_cache_gb=0.5)
QUICK = Sizes(TINYCTX, long=1024, short=8, chunk=128, ttft_pairs=2, system=256, suffix=16, prefix_pairs=2,
              contexts=(128, 512, 1024), decode_steps=8, segments=3, mix_requests=12, mix_concurrent=8,
              mix_prompt=(10, 300), mix_output=(4, 20), slot_max_model_len=512, commits_shape="tiny",
              commits_tokens=4, commits_repeats=2, kv_cache_gb=None)


# ---------------------------------------------------------------------------------------------- helpers
def say(*parts: object) -> None:
    print(*parts, flush=True)


def params(max_tokens: int) -> Any:
    from moeserve.engine.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def load(model: str, sizes: Sizes, **settings: Any) -> Any:
    """An LLMEngine (through LLM, token ids in) with the benchmark's common settings."""
    from moeserve.engine.llm import LLM

    common: dict[str, Any] = {"skip_tokenizer_init": True}
    if sizes.kv_cache_gb is not None:
        common["kv_cache_gb"] = sizes.kv_cache_gb
    return LLM(model, **{**common, **settings}).engine


def close(engine: Any) -> None:
    engine.close()
    gc.collect()


def until_first_token(engine: Any, request_id: str) -> int:
    """Step until `request_id` has a token; returns the steps taken."""
    steps = 0
    while True:
        steps += 1
        for out in engine.step():
            if out.request_id == request_id and out.outputs[0].token_ids:
                return steps
        if not engine.has_unfinished_requests():
            raise RuntimeError(f"request {request_id} ended without a token")


def drain(engine: Any) -> None:
    for rid in list(engine.requests):
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()


def timed_prefill(engine: Any, ids: list[int], rid: str) -> float:
    """Seconds from add to the first token of a max_tokens=1 request."""
    t0 = time.perf_counter()
    engine.add_request(ids, params(1), request_id=rid)
    until_first_token(engine, rid)
    return time.perf_counter() - t0


def secs(x: float) -> str:
    return f"{x:.2f} s" if x >= 1 else f"{x * 1e3:.0f} ms" if x >= 0.01 else f"{x * 1e3:.2f} ms"


def med(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def span(xs: Sequence[float], fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(min(xs))}-{fmt.format(max(xs))}"


# -------------------------------------------------------------------------------------- 1. TTFT, chunks
def ttft_chunked(engine: Any, long_ids: list[int], short_ids: list[int], tag: str) -> tuple[float, float, int]:
    """(first step's seconds, short request's TTFT, steps until it) with the long prompt in chunks."""
    engine.add_request(long_ids, params(1), request_id=f"long{tag}")
    t0 = time.perf_counter()
    out = engine.step()
    first = time.perf_counter() - t0
    assert not out, "the first step of the long prompt is a chunk, not its whole prefill"
    t_add = time.perf_counter()
    engine.add_request(short_ids, params(1), request_id=f"short{tag}")
    steps = until_first_token(engine, f"short{tag}")
    ttft = time.perf_counter() - t_add
    drain(engine)
    return first, ttft, steps


def ttft_unchunked(engine: Any, long_ids: list[int], short_ids: list[int], tag: str) -> tuple[float, float]:
    """(the one-step prefill's seconds, the short request's own time after it: add -> first token)."""
    engine.add_request(long_ids, params(1), request_id=f"long{tag}")
    t0 = time.perf_counter()
    outs = engine.step()
    whole = time.perf_counter() - t0
    assert any(o.request_id == f"long{tag}" and o.outputs[0].token_ids for o in outs), "prefilled in one step"
    t_add = time.perf_counter()
    engine.add_request(short_ids, params(1), request_id=f"short{tag}")
    until_first_token(engine, f"short{tag}")
    own = time.perf_counter() - t_add
    drain(engine)
    return whole, own


def bench_ttft(model: str, sz: Sizes, rows: list[tuple[str, str]]) -> None:
    say(f"\n[1] TTFT of a {sz.short}-token request arriving during a {sz.long}-token prefill")
    chunked = load(model, sz, max_num_batched_tokens=sz.chunk)
    whole = load(model, sz, max_num_batched_tokens=sz.unchunked)
    vocab = sz.shape.vocab_size
    for eng in (chunked, whole):  # warm-up: kernels, allocator
        timed_prefill(eng, make_prompts(1, sz.chunk + sz.short, vocab, 7)[0], "warm")
    firsts, ttft_c, ttft_u, wholes, owns, steps_c = [], [], [], [], [], []
    for rep in range(sz.ttft_pairs):
        long_ids = make_prompts(1, sz.long, vocab, 1000 + rep)[0]
        short_ids = make_prompts(1, sz.short, vocab, 2000 + rep)[0]
        got: dict[str, Any] = {}
        for which in (("c", "u") if rep % 2 == 0 else ("u", "c")):
            if which == "c":
                got["c"] = ttft_chunked(chunked, long_ids, short_ids, f"-{rep}")
            else:
                got["u"] = ttft_unchunked(whole, long_ids, short_ids, f"-{rep}")
        first, tc, steps = got["c"]
        w, own = got["u"]
        firsts.append(first)
        ttft_c.append(tc)
        steps_c.append(steps)
        wholes.append(w)
        owns.append(own)
        ttft_u.append(w - first + own)  # arrives `first` seconds into the one-step prefill
        say(f"  pair {rep}: chunked first step {secs(first)}, short TTFT {secs(tc)} ({steps} step); unchunked "
            f"prefill step {secs(w)} + the short's own {secs(own)} -> TTFT {secs(ttft_u[-1])}")
    close(chunked)
    close(whole)
    ratios = [u / c for u, c in zip(ttft_u, ttft_c)]
    result = (f"chunked ({sz.chunk}) **{secs(med(ttft_c))}** vs unchunked ({sz.unchunked}) **{secs(med(ttft_u))}**: "
              f"**{med(ratios):.1f}x** sooner (pairs {span(ratios, '{:.1f}')}, {len(ratios)}); arrival "
              f"{secs(med(firsts))} into the prefill (the chunked engine's first step); the one-step prefill took "
              f"{secs(med(wholes))}, so without chunks a request arriving just after it started waits "
              f"{secs(med(wholes) + med(owns))}")
    say("  => " + result)
    rows.append((f"1. TTFT, {sz.short}-token request during a {sz.long}-token prefill", result))


# ----------------------------------------------------------------------------------- 2. prefix caching
def bench_prefix(model: str, sz: Sizes, rows: list[tuple[str, str]]) -> None:
    say(f"\n[2] prefill of a second request sharing a {sz.system}-token system prompt (+{sz.suffix} own tokens)")
    on = load(model, sz, max_num_batched_tokens=sz.chunk)
    off = load(model, sz, max_num_batched_tokens=sz.chunk, enable_prefix_caching=False)
    vocab = sz.shape.vocab_size
    for eng in (on, off):
        timed_prefill(eng, make_prompts(1, sz.suffix, vocab, 9)[0], "warm")
    t: dict[str, list[float]] = {k: [] for k in ("on1", "on2", "off1", "off2")}
    hits: list[int] = []
    for rep in range(sz.prefix_pairs):
        system = make_prompts(1, sz.system, vocab, 3000 + rep)[0]
        u1, u2 = make_prompts(2, sz.suffix, vocab, 4000 + rep)
        for name in (("on", "off") if rep % 2 == 0 else ("off", "on")):
            eng = on if name == "on" else off
            before = eng.sequence_memory_stats()["prefix_hit_tokens"]
            t[name + "1"].append(timed_prefill(eng, system + u1, f"a{rep}"))
            mid = eng.sequence_memory_stats()["prefix_hit_tokens"]
            t[name + "2"].append(timed_prefill(eng, system + u2, f"b{rep}"))
            after = eng.sequence_memory_stats()["prefix_hit_tokens"]
            if name == "on":
                hits.append(int(after - mid))
                assert mid == before, "the first request of a fresh system prompt misses"
        say(f"  pair {rep}: on: miss {secs(t['on1'][-1])}, hit {secs(t['on2'][-1])} ({hits[-1]} tokens hit); "
            f"off: {secs(t['off1'][-1])}, {secs(t['off2'][-1])}")
    close(on)
    close(off)
    n = sz.system + sz.suffix
    speedup = [a / b for a, b in zip(t["on1"], t["on2"])]
    vs_off = [a / b for a, b in zip(t["off2"], t["on2"])]
    result = (f"caching on: first (miss) {secs(med(t['on1']))}, second (hit, {med(hits):.0f} of {n} tokens) "
              f"**{secs(med(t['on2']))}** = **{med(speedup):.1f}x** faster (pairs {span(speedup, '{:.1f}')}); "
              f"caching off: {secs(med(t['off1']))} and {secs(med(t['off2']))} (second off / second on "
              f"{med(vs_off):.1f}x)")
    say("  => " + result)
    rows.append((f"2. prefill, 2nd request sharing a {sz.system}-token system prompt", result))


# ------------------------------------------------------------------------------ 3. decode vs context
def kv_bytes_per_token(shape: BenchShape, itemsize: int = 2) -> int:
    """K and V of one position in every layer."""
    return shape.num_layers * 2 * shape.num_kv_heads * shape.head_dim * itemsize


def bench_decode_context(model: str, sz: Sizes, rows: list[tuple[str, str]]) -> None:
    say(f"\n[3] batch-1 decode vs context, beside a memory probe before each {sz.decode_steps}-step segment")
    shape = sz.shape
    weights = resident_step_bytes(shape, 2, batch=1).fast_bytes
    per_pos = kv_bytes_per_token(shape)
    say(f"  bytes per token: weights {weights / 1e6:.1f} MB (dense + top-{shape.top_k} experts per layer) + "
        f"KV {per_pos} B x context")
    eng = load(model, sz, max_num_batched_tokens=sz.chunk, max_num_seqs=1)
    timed_prefill(eng, make_prompts(1, 64, shape.vocab_size, 11)[0], "warm")
    parts = []
    for ctx in sz.contexts:
        rid = f"ctx{ctx}"
        t0 = time.perf_counter()
        eng.add_request(make_prompts(1, ctx, shape.vocab_size, 5000 + ctx)[0],
                        params(2 + sz.segments * sz.decode_steps), request_id=rid)
        until_first_token(eng, rid)
        prefill_s = time.perf_counter() - t0
        eng.step()  # one decode step untimed
        done = 2
        tps, bws, fracs, copies = [], [], [], []
        for _ in range(sz.segments):
            copies.append(ram_copy_bandwidth().bytes_per_s)
            bw = probes.memory_bandwidth()
            t0 = time.perf_counter()
            for _ in range(sz.decode_steps):
                eng.step()
            dt = time.perf_counter() - t0
            mid_ctx = ctx + done + sz.decode_steps / 2
            done += sz.decode_steps
            ceiling = bw / (weights + per_pos * mid_ctx)
            tps.append(sz.decode_steps / dt)
            bws.append(bw)
            fracs.append(tps[-1] / ceiling)
        drain(eng)
        kv_mb = per_pos * ctx / 1e6
        ceil_med = med(bws) / (weights + per_pos * (ctx + sz.segments * sz.decode_steps / 2))
        say(f"  context {ctx}: prefill {prefill_s:.1f} s; {med(tps):.1f} tok/s ({span(tps, '{:.1f}')}); KV "
            f"{kv_mb:.1f} MB/token; probes {span([b / 1e9 for b in bws], '{:.0f}')} GB/s; ceiling at the median "
            f"probe {ceil_med:.1f} tok/s; of ceiling {med(fracs):.0%} ({span(fracs, '{:.0%}')}); copy probe "
            f"{span([c / 1e9 for c in copies], '{:.1f}')} GB/s copied")
        parts.append(f"{ctx}: **{med(tps):.1f} tok/s = {med(fracs):.0%}** of {ceil_med:.0f} (KV {kv_mb:.0f} MB of "
                     f"{(weights + per_pos * ctx) / 1e6:.0f} MB/token)")
    close(eng)
    result = "; ".join(parts)
    say("  => " + result)
    rows.append(("3. batch-1 decode tok/s at context, of the memory-bandwidth ceiling (weights + KV)", result))


# ----------------------------------------------------------------------------------- 4. KV utilisation
def bench_kv_usage(model: str, sz: Sizes, rows: list[tuple[str, str]]) -> None:
    lo, hi = sz.mix_prompt
    olo, ohi = sz.mix_output
    say(f"\n[4] KV used under {sz.mix_requests} requests, {sz.mix_concurrent} at a time, prompts {lo}..{hi}, "
        f"outputs {olo}..{ohi} (seed 0), max_model_len {sz.slot_max_model_len}")
    # default pool: the memory split sizes it for max_num_seqs full-length sequences, what the slot cache reserved
    eng = load(model, dataclasses.replace(sz, kv_cache_gb=None), max_model_len=sz.slot_max_model_len,
               max_num_seqs=sz.mix_concurrent)
    rng = random.Random(0)
    for i in range(sz.mix_requests):
        n, out = rng.randint(lo, hi), rng.randint(olo, ohi)
        eng.add_request([rng.randrange(3, sz.shape.vocab_size) for _ in range(n)], params(out), request_id=f"m{i}")
    bs = eng.kv.block_size
    paged, slot, held_sum, cap_sum = [], [], 0, 0
    peak, total = 0, 0
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
        st = eng.sequence_memory_stats()
        held = sum(s.num_cached for s in eng.scheduler.running)
        used, total = int(st["kv_blocks_used"]), int(st["kv_blocks_total"])
        peak = max(peak, used)
        if used:
            paged.append(held / (used * bs))
            held_sum += held
            cap_sum += used * bs
        slot.append(held / (sz.mix_concurrent * sz.slot_max_model_len))
    seconds = time.perf_counter() - t0
    st = eng.sequence_memory_stats()
    close(eng)
    verdict = "meets" if med(paged) >= 0.90 and min(paged) >= 0.90 else "MISSES"
    result = (f"paged: tokens held / (blocks used x {bs}) **{statistics.fmean(paged):.3f}** mean over "
              f"{len(paged)} steps (min {min(paged):.3f}; token-weighted {held_sum / cap_sum:.3f}; {verdict} the "
              f">= 0.90 target); old slot cache (tokens held / ({sz.mix_concurrent} x {sz.slot_max_model_len})): "
              f"**{statistics.fmean(slot):.3f}** mean (max {max(slot):.3f}); peak blocks used **{peak} of {total}** "
              f"({peak / total:.0%}); {int(st['preemptions'])} preemptions; {seconds:.0f} s")
    say("  => " + result)
    rows.append(("4. KV memory used / reserved, mixed workload", result))
