"""`moeserve simulate TRACE`: replay a routing trace through the eviction policies; table, plot, JSON."""

from __future__ import annotations

import argparse
import difflib
import json
from pathlib import Path
from typing import Any

from moeserve.bench.simulate import (
    BYPASS_SUFFIX,
    PREFETCH_MODES,
    GridResult,
    LayerCall,
    OnlinePrefetch,
    calls_from_steps,
    run_grid,
    split_bypass,
)
from moeserve.bench.traces import INPUT_FORMATS, load_trace
from moeserve.errors import ConfigError
from moeserve.experts.policies import ONLINE_POLICY_NAMES, POLICY_NAMES
from moeserve.experts.quota import CACHE_MODES, DEFAULT_CACHE_MODE
from moeserve.experts.traces.moetrace import TraceHeader


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="replay a routing trace through the expert-cache eviction policies",
        description="Hit rate of each eviction policy and cache capacity on a recorded routing trace, with "
        "Belady (the offline optimum) as the bound. TRACE is a moeserve trace file (binary or JSON lines) or a "
        "FLAME-MoE CSV folder.",
    )
    p.add_argument("trace", metavar="TRACE",
                   help="trace file (record_trace, or JSON lines: docs/trace-format.md) or FLAME-MoE Layer_N/ folder")
    p.add_argument("--trace-format", choices=INPUT_FORMATS, default="auto",
                   help="format of TRACE (default: detected from its content)")
    p.add_argument("--policy", default=",".join(POLICY_NAMES),
                   help=f"comma-separated (default: all); an online policy + '{BYPASS_SUFFIX}' (e.g. lfru{BYPASS_SUFFIX}) adds "
                   "admission control: misses it does not admit are served uncached (the engine's expert_admission=policy)")
    p.add_argument("--capacity", default="32,64,128,256", help="comma-separated cache sizes, in experts")
    p.add_argument("--prefetch", default="none", help=f"comma-separated: {', '.join(PREFETCH_MODES)}")
    p.add_argument("--cache-mode", default=DEFAULT_CACHE_MODE,
                   help=f"comma-separated capacity modes (the engine's expert_cache_mode): {', '.join(CACHE_MODES)}")
    p.add_argument(
        "--warmup-fraction",
        "--static-warmup-fraction",
        dest="warmup_fraction",
        type=float,
        default=0.5,
        help="with static or affinity: fit on this first fraction of steps, evaluate ALL on the rest",
    )
    p.add_argument("--affinity-width", type=int, default=None, help="experts prefetched per layer (affinity)")
    p.add_argument(
        "--online-width",
        type=int,
        default=None,
        help="online prefetch: at most this many guesses per layer call (default: as many experts as the call "
        "needed, as the engine does)",
    )
    p.add_argument(
        "--online-min-prob",
        type=float,
        default=0.4,
        help="online prefetch: only guesses whose calibrated chance of being used is at least this",
    )
    p.add_argument(
        "--expert-mib",
        type=float,
        default=None,
        help="size of one expert in MiB: the tables then also give MiB read per step",
    )
    p.add_argument("--plot", type=Path, default=None, help="write a PNG of hit rate vs capacity")
    p.add_argument("--json", type=Path, default=None, help="write all results as JSON")
    p.set_defaults(func=run)


def _split(text: str, what: str, choices: tuple[str, ...]) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    for item in items:
        if item not in choices:
            close = difflib.get_close_matches(item, choices, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"--{what} {item!r}: choose from {', '.join(choices)}{hint}")
    if not items:
        raise ConfigError(f"--{what}: give at least one value")
    return items


def _capacities(text: str) -> list[int]:
    try:
        caps = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError as err:
        raise ConfigError(f"--capacity {text!r}: expected comma-separated integers") from err
    if not caps or caps[0] < 1:
        raise ConfigError(f"--capacity {text!r}: capacities must be >= 1 expert")
    return caps


def load_calls(path: str | Path, fmt: str = "auto") -> tuple[TraceHeader, list[list[LayerCall]], list[str]]:
    """A trace of any format (`moeserve.bench.traces`) -> header, the layer calls of every step, and a note per
    header field that was inferred."""
    trace = load_trace(path, fmt)
    return trace.header, calls_from_steps(trace.steps), trace.notes


def run(args: argparse.Namespace) -> int:
    policies = _split(args.policy, "policy", POLICY_NAMES + tuple(p + BYPASS_SUFFIX for p in ONLINE_POLICY_NAMES))
    prefetches = _split(args.prefetch, "prefetch", PREFETCH_MODES)
    cache_modes = _split(args.cache_mode, "cache-mode", CACHE_MODES)
    capacities = _capacities(args.capacity)
    header, steps, notes = load_calls(args.trace, args.trace_format)
    for note in notes:
        print(note)
    if (args.online_width is not None and args.online_width < 1) or not 0.0 <= args.online_min_prob <= 1.0:
        raise ConfigError("--online-width must be >= 1 and --online-min-prob in [0, 1]")
    online = OnlinePrefetch(header.num_experts, args.online_width, args.online_min_prob)
    grid = run_grid(
        steps, policies, capacities, prefetches, args.warmup_fraction, None, args.affinity_width, online, cache_modes
    )
    total = header.num_experts * len(header.moe_layers)
    print(
        f"{header.model}: {len(header.moe_layers)} MoE layers x {header.num_experts} experts = {total}; "
        f"fitted on {grid.fit_steps} steps, evaluated on {grid.eval_steps}"
    )
    if "online" in prefetches:
        width = "as many as it needed experts" if args.online_width is None else str(args.online_width)
        print(
            f"online prefetch (the engine's guesses): per layer call, up to {width} guesses with chance >= "
            f"{args.online_min_prob:g}; uncached ones read while such guesses were used as often"
        )
    for mode in cache_modes:
        if len(cache_modes) > 1 or mode != DEFAULT_CACHE_MODE:
            print(f"\n=== expert cache mode {mode}")
        print(format_table(grid, policies, capacities, prefetches, args.expert_mib, mode))
    if args.json:
        args.json.write_text(json.dumps(_json(header, grid), indent=1))
    if args.plot:
        plot(grid, policies, capacities, prefetches, args.plot, header.model, cache_modes[0])
    return 0


def format_table(
    grid: GridResult,
    policies: list[str],
    capacities: list[int],
    prefetches: list[str],
    expert_mib: float | None = None,
    cache_mode: str = DEFAULT_CACHE_MODE,
) -> str:
    """Hit rate and experts read per step, per policy x capacity, per prefetch mode; then the best online
    policy's hit rate as a fraction of Belady's: demand-only Belady at the same capacity (the bound on the
    demand hit rate without prefetch), and Belady given the same prefetches."""
    unit = "MiB" if expert_mib else "experts"
    lines = [f"cells: hit rate (reads per step, in {unit}; a step is one token at batch 1)"]
    for prefetch in prefetches:
        lines.append(f"\nprefetch={prefetch}")
        lines.append(f"{'policy':<12}" + "".join(f"{c:>18}" for c in capacities))
        for policy in policies:
            cells = []
            for c in capacities:
                r = grid.get(policy, c, prefetch, cache_mode)
                reads = r.reads_per_step * (expert_mib or 1.0) if r else 0.0
                cells.append(f"{r.hit_rate:.3f} ({reads:5.1f})" if r else "-")
            lines.append(f"{policy:<12}" + "".join(f"{x:>18}" for x in cells))
        if "belady" not in policies or not any(split_bypass(p)[0] in ONLINE_POLICY_NAMES for p in policies):
            continue
        bounds = [("vs MIN", "none")] if "none" in prefetches else []
        if prefetch != "none":
            bounds.append(("vs MIN+pf", prefetch))
        for label, bound_mode in bounds:
            cells = []
            for c in capacities:
                bound = grid.get("belady", c, bound_mode, cache_mode)
                online = [grid.get(p, c, prefetch, cache_mode) for p in policies
                          if split_bypass(p)[0] in ONLINE_POLICY_NAMES]
                best = max((r for r in online if r), key=lambda r: r.hit_rate)
                ratio = best.hit_rate / bound.hit_rate if bound and bound.hit_rate else float("nan")
                cells.append(f"{best.policy} {ratio:.2f}")
            lines.append(f"{label:<12}" + "".join(f"{x:>18}" for x in cells))
    return "\n".join(lines)


def _json(header: TraceHeader, grid: GridResult) -> dict[str, Any]:
    return {
        "header": header.to_json(),
        "fit_steps": grid.fit_steps,
        "eval_steps": grid.eval_steps,
        "results": [r.to_json() for r in grid.results],
    }


def plot(
    grid: GridResult, policies: list[str], capacities: list[int], prefetches: list[str], out: Path, title: str,
    cache_mode: str = DEFAULT_CACHE_MODE,
) -> None:
    """Hit rate and reads per step vs capacity, one line per policy and prefetch mode, for one capacity mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_reads) = plt.subplots(1, 2, figsize=(12, 4.8))
    styles = ["-", "--", ":", "-."]
    colors = {p: f"C{i}" for i, p in enumerate(policies)}  # one colour per policy, one style per prefetch
    for i, prefetch in enumerate(prefetches):
        for policy in policies:
            runs = [grid.get(policy, c, prefetch, cache_mode) for c in capacities]
            style = dict(linestyle=styles[i % len(styles)], marker="o", markersize=3, color=colors[policy])
            ax.plot(
                capacities,
                [r.hit_rate if r else float("nan") for r in runs],
                **style,
                label=f"{policy} ({prefetch})",
            )
            ax_reads.plot(capacities, [r.reads_per_step if r else float("nan") for r in runs], **style)
    ax.set_xlabel("cache capacity (experts, one cache for all layers)")
    ax.set_ylabel("hit rate")
    ax.set_ylim(0, 1)
    ax.set_title(f"{title}: expert cache hit rate")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=len(prefetches))
    ax_reads.set_xlabel("cache capacity (experts)")
    ax_reads.set_ylabel("experts read per step (misses + prefetches)")
    ax_reads.set_ylim(bottom=0)
    ax_reads.set_title("reads per step (one token at batch 1)")
    ax_reads.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
