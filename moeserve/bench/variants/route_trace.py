"""Offloaded speed under real locality: `moeserve bench --route-trace` at several expert-cache sizes, moeserve's
default against its variants (LRU, prefetch on, prefetch auto, admission control), alternated in each run, then one
table of every run.

Each fraction is one `moeserve bench` run in its own process (its JSON in --out-dir); --synthetic adds, per
fraction, the same run on the synthetic routers, for the contrast with near-uniform routing. 'of ceil' is the
fraction of the ceiling from the run's own bytes (dense from memory, each miss from disk at the probed bandwidth):
the I/O ceiling of an offloaded run.

    moeserve bench route-trace --shape small --trace /work/shared/traces/flame-moe-290m \\
        --fractions 0.1,0.25,0.5 --out-dir /tmp/route-bench
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from moeserve.bench.variants import add_parser, add_repeats_flag

VARIANTS = "moeserve-prefetch,moeserve-lru,moeserve-prefetch-auto,moeserve-admission"


def register(sub: argparse._SubParsersAction) -> None:
    p = add_parser(sub, "route-trace", __doc__)
    p.add_argument("--trace", type=Path, required=True, help="routing trace (moetrace, JSON lines or FLAME folder)")
    p.add_argument("--shape", default="small", help="bench shape (moeserve bench --help lists them)")
    p.add_argument("--fractions", default="0.1,0.25,0.5", help="expert cache sizes, fractions of all experts")
    p.add_argument("--peers", default=VARIANTS, help=f"moeserve variants beside the default (default {VARIANTS})")
    p.add_argument("--cases", default="decode-b1", help="moeserve bench cases (default decode-b1)")
    p.add_argument("--tokens", type=int, default=32, help="decode steps timed per run")
    add_repeats_flag(p, 3)
    p.add_argument("--synthetic", action="store_true", help="also run each fraction on the synthetic routers")
    p.add_argument("--memory-limit-gb", type=float, default=None, help="moeserve bench --memory-limit-gb")
    p.add_argument("--cache-dir", type=Path, default=None, help="moeserve bench --cache-dir")
    p.add_argument("--out-dir", type=Path, default=Path("route-bench"), help="where each run's JSON and the table go")
    p.set_defaults(func=run)


def _fractions(text: str) -> list[float]:
    from moeserve.errors import ConfigError

    try:
        fractions = [float(f) for f in text.split(",") if f.strip()]
    except ValueError as err:
        raise ConfigError(f"--fractions {text!r}: expected comma-separated numbers") from err
    if not fractions or not all(0 < f <= 1 for f in fractions):
        raise ConfigError(f"--fractions {text!r}: each must be in (0, 1]")
    return fractions


def _run_one(args: argparse.Namespace, fraction: float, trace: Path | None) -> dict[str, Any]:
    """One `moeserve bench` run in a child process; its JSON summary."""
    from moeserve.errors import MoeserveError

    out = args.out_dir / f"{args.shape}-{fraction:g}-{'trace' if trace else 'synthetic'}.json"
    argv = ["bench", "--shape", args.shape, "--cases", args.cases, "--peers", args.peers, "--tokens",
            str(args.tokens), "--repeats", str(args.repeats), "--expert-cache-fraction", str(fraction),
            "--json", str(out)]
    argv += ["--route-trace", str(trace)] if trace else []
    argv += ["--memory-limit-gb", str(args.memory_limit_gb)] if args.memory_limit_gb else []
    argv += ["--cache-dir", str(args.cache_dir)] if args.cache_dir else []
    if subprocess.run([sys.executable, "-m", "moeserve", *argv]).returncode != 0:
        raise MoeserveError(f"moeserve {' '.join(argv)} failed")
    return dict(json.loads(out.read_text()))


def _mb(row: dict[str, Any], key: str) -> str:
    return "-" if row.get(key) is None else f"{row[key] / 1e6:.1f}"


def _row(fraction: float, routing: str, row: dict[str, Any], default: dict[str, Any]) -> str:
    vs = row["tokens_per_s"] / default["tokens_per_s"] if default["tokens_per_s"] else float("nan")
    hit = "-" if row["expert_hit_rate"] is None else f"{row['expert_hit_rate']:.1%}"
    pf = "-" if row.get("prefetched_per_token") is None else f"{row['prefetched_per_token']:.1f}"
    byp = "-" if row.get("bypassed_per_token") is None else f"{row['bypassed_per_token']:.1f}"
    charged = "-" if not row.get("memory_peak_bytes") else f"{row['memory_peak_bytes'] / 2**20:.0f}Mi"
    # the median of (this run / the default's run of the same round): the machine's drift cancels per pair
    paired = "-" if not row.get("moeserve_speedup") else f"{1 / row['moeserve_speedup']:.2f}x"
    runs_tps = row["runs_tokens_per_s"]
    spread = f"{min(runs_tps):.2f}-{max(runs_tps):.2f}"
    return (f"{fraction:>6.0%} {routing:<9} {row['case']:<10} {row['engine']:<24} {row['tokens_per_s']:>7.2f} "
            f"{spread:>11} {row['fraction_of_ceiling']:>7.0%} {vs:>6.2f}x {paired:>7} {hit:>8} "
            f"{_mb(row, 'bytes_per_token_disk'):>11} {_mb(row, 'bytes_per_token_host'):>11} {pf:>6} {byp:>7} "
            f"{charged:>9}")


def table(runs: list[tuple[float, str, dict[str, Any]]]) -> str:
    """One line per (fraction, routing, case, engine) of every run, then what each run skipped and its load."""
    header = (f"{'cache':>6} {'routing':<9} {'case':<10} {'engine':<24} {'tok/s':>7} {'runs':>11} {'of ceil':>7} "
              f"{'vs dflt':>7} {'paired':>7} {'hit rate':>8} {'MB/tok disk':>11} {'MB/tok host':>11} {'pf/tok':>6} "
              f"{'byp/tok':>7} {'charged':>9}")
    lines = [header, "-" * len(header)]
    for fraction, routing, summary in runs:
        rows = summary["rows"]
        for row in rows:
            default = next(r for r in rows if r["case"] == row["case"] and r["engine"] == "moeserve")
            lines.append(_row(fraction, routing, row, default))
        lines += [f"{'':>6} skipped {s['engine']}: {s['reason']}" for s in summary["skipped"]]
        loads = [x for row in rows for x in row.get("runs_load_average", []) if x is not None]
        if loads:
            lines.append(f"{'':>6} load average (1 min) after each timed run: {min(loads):.1f}-{max(loads):.1f}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from moeserve.errors import ConfigError

    if not args.trace.exists():
        raise ConfigError(f"--trace {args.trace}: no such file or folder")
    fractions = _fractions(args.fractions)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    for fraction in fractions:
        runs.append((fraction, "trace", _run_one(args, fraction, args.trace)))
        if args.synthetic:
            runs.append((fraction, "synthetic", _run_one(args, fraction, None)))
    text = table(runs)
    print(f"\nshape {args.shape}, trace {args.trace}, {args.tokens} tokens x {args.repeats} runs per engine\n{text}")
    (args.out_dir / f"{args.shape}-table.txt").write_text(text + "\n")
    return 0
