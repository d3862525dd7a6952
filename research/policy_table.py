"""The expert-cache policy table of docs/policies.md: every policy x capacity x prefetch mode x capacity mode on a
routing trace, and the issue-19 target per capacity: the best online policy (prefetch allowed) against demand-only
Belady, in hit rate (>= 0.9x) and in reads (<= 1.5x).

    .venv/bin/python research/policy_table.py /work/shared/traces/flame-moe-290m \
        --capacity 64,96,128,192,256,384 --out /tmp/flame-table.md --json /tmp/flame-table.json

Long grids can run in parts (e.g. one process per capacity mode, each with --json) and be put together with
`--from-json part1.json part2.json ...` (no simulation then; the header line needs the trace again).

Same replay as `moeserve simulate` (the engine's SlotCache; the first half of the steps only teaches the online
predictor and fits static's profile, every cell is evaluated on the second half from a cold cache).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from moeserve.bench.simulate import GridResult, OnlinePrefetch, SimResult, run_grid, split_bypass
from moeserve.cli.simulate import load_calls
from moeserve.experts.policies import ONLINE_POLICY_NAMES

HIT_TARGET, READ_TARGET = 0.9, 1.5


def cell(r: SimResult | None) -> str:
    return f"{r.hit_rate:.3f} ({r.reads_per_step:.1f})" if r else "-"


def grid_table(grid: GridResult, mode: str, policies: list[str], caps: list[int], prefetches: list[str]) -> list[str]:
    lines = ["| prefetch | policy | " + " | ".join(str(c) for c in caps) + " |",
             "|---|---|" + "---|" * len(caps)]
    for prefetch in prefetches:
        for policy in policies:
            cells = [cell(grid.get(policy, c, prefetch, mode)) for c in caps]
            lines.append(f"| {prefetch} | {policy} | " + " | ".join(cells) + " |")
    return lines


def target_rows(grid: GridResult, modes: list[str], caps: list[int]) -> list[str]:
    """Per capacity (where demand-only Belady >= 0.3): the best online cell within 1.5x Belady's reads, and the
    cheapest online cell reaching 0.9x Belady's hit rate; online = any mode, policy and prefetch but Belady."""
    lines = ["| capacity | Belady (demand, shared) | best online within 1.5x reads | hit / Belady | "
             "cheapest online at >= 0.9x hit | reads / Belady | target |", "|---|---|---|---|---|---|---|"]
    for c in caps:
        bound = grid.get("belady", c, "none", "shared")
        if bound is None or bound.hit_rate < 0.3:
            continue
        online = [r for r in grid.results if r.capacity == c and split_bypass(r.policy)[0] in ONLINE_POLICY_NAMES]
        cheap = [r for r in online if r.reads <= READ_TARGET * bound.reads]
        best = max(cheap, key=lambda r: r.hit_rate, default=None)
        good = [r for r in online if r.hit_rate >= HIT_TARGET * bound.hit_rate]
        cheapest = min(good, key=lambda r: r.reads, default=None)
        met = best is not None and best.hit_rate >= HIT_TARGET * bound.hit_rate
        lines.append(
            f"| {c} | {cell(bound)} | {name(best)} {cell(best)} | {ratio(best, bound, 'hit_rate')} | "
            f"{name(cheapest)} {cell(cheapest)} | {ratio(cheapest, bound, 'reads')} | {'met' if met else 'not met'} |")
    return lines


def name(r: SimResult | None) -> str:
    return f"{r.policy}+{r.prefetch} ({r.cache_mode})" if r else "none"


def ratio(r: SimResult | None, bound: SimResult, attr: str) -> str:
    return f"{getattr(r, attr) / getattr(bound, attr):.2f}" if r and getattr(bound, attr) else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--capacity", default="64,96,128,192,256,384")
    ap.add_argument("--policy", default="lru,lfu,lfru,static,belady")
    ap.add_argument("--prefetch", default="none,online,auto")
    ap.add_argument("--cache-mode", default="shared,per_layer,mixed")
    ap.add_argument("--online-min-prob", type=float, default=0.4)
    ap.add_argument("--out", type=Path, default=None, help="also write the markdown here")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--from-json", type=Path, nargs="+", default=None, help="tables from these --json outputs")
    args = ap.parse_args()
    caps = [int(x) for x in args.capacity.split(",")]
    policies, prefetches, modes = (args.policy.split(","), args.prefetch.split(","), args.cache_mode.split(","))
    header, steps, _ = load_calls(args.trace)
    if args.from_json:
        names = {f.name for f in dataclasses.fields(SimResult)}
        rows = [r for path in args.from_json for r in json.loads(path.read_text())]
        results = [SimResult(**{k: v for k, v in r.items() if k in names}) for r in rows]
        for r in results:
            r.per_layer = {int(k): tuple(v) for k, v in r.per_layer.items()}  # type: ignore[misc]
        grid = GridResult(results, fit_steps=len(steps) // 2, eval_steps=len(steps) - len(steps) // 2)
    else:
        online = OnlinePrefetch(header.num_experts, None, args.online_min_prob)
        grid = run_grid(steps, policies, caps, prefetches, 0.5, None, None, online, modes)
    lines = [f"{header.model}: {len(header.moe_layers)} MoE layers x {header.num_experts} experts, top-{header.top_k}; "
             f"fitted on {grid.fit_steps} steps, evaluated on {grid.eval_steps}. Cells: hit rate (experts read per "
             "step).", ""]
    for mode in modes:
        lines += [f"Capacity mode `{mode}`:", "", *grid_table(grid, mode, policies, caps, prefetches), ""]
    lines += ["Target (hit >= 0.9x and reads <= 1.5x demand-only Belady, shared):", "", *target_rows(grid, modes, caps)]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    if args.json:
        args.json.write_text(json.dumps([r.to_json() for r in grid.results], indent=1))


if __name__ == "__main__":
    main()
