"""Sequence memory: the paged KV cache, chunked prefill and prefix caching, measured in one run.

Figures (compared configurations alternate A B A B ..., each figure the median of its runs):
1. TTFT of a short request (32-token prompt, max_tokens 1) that arrives while a 16k-token prompt is prefilling, with
   chunked prefill (max_num_batched_tokens 2048, the default) and without (16448: the whole prompt in one step).
   Chunked: step the long request once (its first chunk), add the short one, time add -> its first token. Without
   chunks that first step is the whole prefill, so the short request is given the same arrival moment (as long
   after the long request's start as the chunked engine's first step took): it waits for the rest of the one
   big step (the engine, like the server's loop, takes new requests between steps), then for its own step.
2. Prefill (add -> first token) of a second request sharing a 2048-token system prompt with the first, prefix
   caching on (first: miss; second: hit of the shared full blocks) and off.
3. Batch-1 decode tokens/s at contexts of 1k, 8k and 32k (prefilled once, then segments of N steps), each segment
   beside a memory probe: ceiling = probe / (weights read per token + KV bytes at that context).
4. KV memory used under a mixed workload (24 requests, 8 at a time, prompts 50..3000 and outputs 20..200 tokens
   drawn uniformly from a seeded generator): per step, tokens held / (blocks used x block_size), and the old slot
   cache's figure for the same steps, tokens held / (max_num_seqs x max_model_len) with max_model_len 4096.
5. Batch-1 decode tokens/s against the pre-paging commit bdd20de: `moeserve bench commits` on the small shape
   (needs a git checkout of moeserve).

Model for 1-4: a bench shape with a 40k context (`longctx`): the small shape's MoE (32 experts x 512, top-4, hidden
1024) in 8 layers with 8 query heads and 2 KV heads (4 KiB of KV per token). Prefill attention re-reads the keys of
every earlier position for each query row, so its time grows with KV bytes per token x length^2: the small shape
(16 KiB per token) takes ~2.3 min for a 16k prompt here and ~9 for 32k; this one ~1 and ~2.

    moeserve bench sequence-memory                        # full run (~10 min)
    moeserve bench sequence-memory --quick --items 1,2,3,4  # smoke run on a tiny model (< 2 min)
"""

from __future__ import annotations

import argparse
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moeserve.bench.variants import add_parser

SECTION = "Sequence memory (paged KV, chunked prefill, prefix caching)"
PRE_PAGING = "bdd20de"
ITEMS = (1, 2, 3, 4, 5)


def register(sub: argparse._SubParsersAction) -> None:
    p = add_parser(sub, "sequence-memory", __doc__)
    p.add_argument("--quick", action="store_true", help="smoke run on a tiny model, sizes scaled down (< 2 min)")
    p.add_argument("--items", default="1,2,3,4,5", help="which figures to measure (comma-separated, of 1-5)")
    p.add_argument("--docs", type=Path, default=None, help="also append the report as a markdown section to this file")
    p.add_argument("--cache-dir", type=Path, default=None, help="where the bench checkpoints are cached")
    p.set_defaults(func=run)


# ------------------------------------------------------------------------------------- 5. vs bdd20de
COMMITS_LINE = re.compile(r"decode-b1: this ([\d.]+) tok/s, other ([\d.]+) tok/s; ratio this/other median ([\d.]+) "
                          r"\(min ([\d.]+), max ([\d.]+), (\d+) pairs\)")


def bench_commits(sz: Any, rows: list[tuple[str, str]]) -> None:
    """Figure 5: `moeserve bench commits PRE_PAGING` in a child process, its decode-b1 line read back."""
    from moeserve.bench.sequence_memory import say

    argv = ["bench", "commits", PRE_PAGING, "--shape", sz.commits_shape, "--batches", "1", "--tokens",
            str(sz.commits_tokens), "--repeats", str(sz.commits_repeats)]
    shown = "moeserve " + " ".join(argv)
    say(f"\n[5] batch-1 decode vs the pre-paging commit {PRE_PAGING}: {shown}")
    proc = subprocess.run([sys.executable, "-m", "moeserve", *argv], capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        say("  " + line)
    m = COMMITS_LINE.search(proc.stdout)
    if proc.returncode != 0 or m is None:
        tail = "\n".join(proc.stderr.splitlines()[-15:])
        say(f"  {shown} failed (exit {proc.returncode}):\n{tail}")
        rows.append((f"5. batch-1 decode vs {PRE_PAGING}", f"`{shown}` failed (exit {proc.returncode})"))
        return
    this, other, ratio, lo, hi, n = m.groups()
    differ = "greedy outputs differ" in proc.stdout
    verdict = "within" if float(ratio) >= 0.97 else "NOT within"
    result = (f"`{shown}`: this {this} vs {other} tok/s, ratio **{ratio}** ({lo}-{hi}, {n} pairs; {verdict} 3%)"
              + ("; greedy outputs differ" if differ else "; same greedy outputs"))
    say("  => " + result)
    rows.append((f"5. batch-1 decode vs {PRE_PAGING} ({sz.commits_shape} shape, resident)", result))


# ---------------------------------------------------------------------------------------------- report
def git_head() -> str:
    """The short hash of the checkout moeserve is imported from, or "?" outside a git checkout."""
    import moeserve

    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(moeserve.__file__).parent,
                         capture_output=True, text=True)
    return out.stdout.strip() or "?"


def cpu_flags() -> str:
    try:
        flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")).split()
    except (OSError, StopIteration):
        return ""
    return ", ".join(f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f in flags)


def doc_section(rows: list[tuple[str, str]], command: str, machine: dict[str, Any], t_start: str, t_end: str,
                sz: Any) -> str:
    """The report as a markdown section: when, where, on which model, then one table row per figure."""
    from moeserve.bench.sequence_memory import kv_bytes_per_token

    s = sz.shape
    head = (f"## {SECTION} ({t_start[:10]}, {t_start[11:16]}-{t_end[11:16]} UTC)\n\n"
            f"`{command}` at {git_head()} plus the working tree, one run. "
            f"Machine: {machine['cpu']} ({cpu_flags()}), {machine['cores']} cores, torch {machine['torch']}, "
            f"{machine['threads']} threads, Python {platform.python_version()}; shared with other work, so only "
            "paired ratios and fractions of a ceiling measured beside the run mean much.\n\n"
            f"Model for 1-4: bench shape `{s.name}` (Qwen3-MoE, random bf16 weights): hidden {s.hidden_size}, "
            f"{s.num_layers} layers, {s.num_experts} experts x {s.moe_intermediate_size}, top-{s.top_k}, "
            f"{s.num_heads} query / {s.num_kv_heads} KV heads of {s.head_dim}, vocab {s.vocab_size}, context "
            f"{s.max_position_embeddings} ({kv_bytes_per_token(s)} bytes of KV per token). Compared "
            "configurations alternate (A B A B), each figure is the median of its runs.\n\n")
    table = "| figure | result |\n|---|---|\n" + "".join(f"| {a} | {b} |\n" for a, b in rows)
    return head + table


def _items(text: str) -> set[int]:
    from moeserve.errors import ConfigError

    try:
        items = {int(i) for i in text.split(",") if i.strip()}
    except ValueError as err:
        raise ConfigError(f"--items {text!r}: expected comma-separated figure numbers") from err
    if not items or not items <= set(ITEMS):
        raise ConfigError(f"--items {text!r}: figures are numbered {ITEMS[0]}-{ITEMS[-1]}")
    return items


def run(args: argparse.Namespace) -> int:
    from moeserve.bench import sequence_memory as fig
    from moeserve.bench.runner import machine_info
    from moeserve.bench.synth import ensure_checkpoint

    items = _items(args.items)
    sz = fig.QUICK if args.quick else fig.FULL
    t_start = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    machine = machine_info()
    fig.say(f"{SECTION}: {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']}, {t_start}")
    model = str(ensure_checkpoint(sz.shape, args.cache_dir))
    fig.say(f"model: {model}")
    rows: list[tuple[str, str]] = []
    steps: list[tuple[int, Callable[[], None]]] = [
        (1, lambda: fig.bench_ttft(model, sz, rows)),
        (2, lambda: fig.bench_prefix(model, sz, rows)),
        (3, lambda: fig.bench_decode_context(model, sz, rows)),
        (4, lambda: fig.bench_kv_usage(model, sz, rows)),
        (5, lambda: bench_commits(sz, rows)),
    ]
    for item, measure in steps:
        if item in items:
            measure()
    t_end = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    command = " ".join(["moeserve bench sequence-memory", *(["--quick"] if args.quick else []),
                        "--items", ",".join(map(str, sorted(items)))])
    section = doc_section(rows, command, machine, t_start, t_end, sz)
    fig.say("\n" + section)
    if args.docs is not None:
        with open(args.docs, "a") as f:
            f.write("\n" + section)
        fig.say(f"appended to {args.docs}")
    return 0
