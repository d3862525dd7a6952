"""Turn timed runs into the figures the benchmark prints and writes: tokens/s, ceiling, fraction of it, peak RSS,
expert hit rate, bytes per token from each tier, and ratios to moeserve."""

from __future__ import annotations

import statistics
from typing import Any

from moeserve.bench import ceilings
from moeserve.bench.runner import BenchConfig, CaseResult, Skipped, _batch_of, paired_ratio

# (dense, expert) weight bytes per parameter as each engine stores them. moeserve's int8 quantizes the experts
# (per-output-channel scales, negligible) and, with its C++ kernels, the dense Linears but routers: its dense bytes
# come from ceilings.dense_bytes_per_step_int8 (the 1.0 here is not used); Q8_0 is 32 int8 + one fp16 scale per
# block of 32, dense and experts. int4 quantizes the experts to a nibble + a bf16 scale per 32 inputs and the dense
# Linears as int8 does (the 2.0 here is not used either). A
# quantized GGUF's mix of types (Q4_K_M: Q4_K, Q6_K where llama.cpp's rule keeps more bits) is read from the file
# (engines.BenchEngine.bytes_per_param), not from here.
BYTES_PER_PARAM: dict[str, tuple[float, float]] = {
    "moeserve": (2.0, 2.0), "moeserve-int8": (1.0, 1.0), "moeserve-int4": (2.0, 0.5 + 2 / 32),
    "transformers": (2.0, 2.0), "accelerate": (2.0, 2.0),
    "llama.cpp": (2.0, 2.0), "llama.cpp-q8": (34 / 32, 34 / 32), "moeserve-no-prefetch": (2.0, 2.0),
    "moeserve-torch-kernels": (2.0, 2.0), "moeserve-plain-experts": (2.0, 2.0),
    "moeserve-per-op": (2.0, 2.0), "moeserve-batch-variant": (2.0, 2.0), "moeserve-lru": (2.0, 2.0),
    "moeserve-prefetch": (2.0, 2.0), "moeserve-prefetch-auto": (2.0, 2.0),
    "moeserve-admission": (2.0, 2.0)}


def dense_bytes(cfg: BenchConfig, engine: str, engine_key: str, bytes_per_param: tuple[float, float],
                tokens_per_step: int) -> int:
    """Non-expert bytes of one step as `engine` (`engine_key` in BYTES_PER_PARAM) stores them. moeserve's int8
    dense GEMV (quantization int8 and int4) needs its C++ kernels (kernels=auto finds them on the bench machines;
    the torch-kernels peer keeps the dense Linears in bf16)."""
    if engine_key in ("moeserve-int8", "moeserve-int4"):
        if engine != "moeserve-torch-kernels":
            return ceilings.dense_bytes_per_step_int8(cfg.shape, tokens_per_step)
        return ceilings.dense_bytes_per_step(cfg.shape, 2.0, tokens_per_step)
    return ceilings.dense_bytes_per_step(cfg.shape, bytes_per_param[0], tokens_per_step)


def step_bytes_from_store(cfg: BenchConfig, bytes_per_param: tuple[float, float], tokens_per_step: int,
                          store: dict[str, float], steps: int, dense: int | None = None) -> ceilings.StepBytes:
    """Bytes of one step, with expert traffic measured by moeserve's store (hits from memory, misses from disk);
    `dense`: the non-expert bytes when not dense_bytes_per_step at bytes_per_param[0]."""
    shape = cfg.shape
    accesses = (store.get("hits", 0) + store.get("misses", 0)) / max(steps, 1)  # distinct experts per step
    miss_share = store.get("misses", 0) / max(store.get("hits", 0) + store.get("misses", 0), 1)
    expert_bytes = accesses * shape.expert_params * bytes_per_param[1]
    if dense is None:
        dense = ceilings.dense_bytes_per_step(shape, bytes_per_param[0], tokens_per_step)
    return ceilings.StepBytes(dense, expert_bytes * (1 - miss_share), expert_bytes * miss_share)


def decode_context(cfg: BenchConfig) -> int:
    """Tokens a sequence holds before the middle timed decode step: the prompt, its first token and half the steps."""
    return cfg.prompt_len + 1 + cfg.new_tokens // 2


def sequence_memory(cfg: BenchConfig) -> dict[str, Any]:
    """The sequence memory one decode step of one sequence reads and writes, by kind, at decode_context (counted in
    every decode row's ceiling), and, for latent attention, the KV bytes per token beside full KV."""
    context = decode_context(cfg)
    return {"context_tokens": context, "bytes_per_step": ceilings.sequence_bytes_per_step(cfg.shape, context),
            "kv_per_token": ceilings.kv_per_token(cfg.shape)}


def summarize(cfg: BenchConfig, results: list[CaseResult], skipped: list[Skipped],
              bandwidths: dict[str, float], machine: dict[str, Any],
              load_rss: dict[str, int], file_bytes: dict[str, tuple[float, float]] | None = None) -> dict[str, Any]:
    """The whole benchmark as one JSON-ready dict; rows are one per (case, engine). `file_bytes`: an engine's
    (dense, expert) bytes per parameter as its weight file stores them, over BYTES_PER_PARAM."""
    by_key = {(r.case, r.engine): r for r in results}
    seq_memory = sequence_memory(cfg)
    per_sequence = sum(seq_memory["bytes_per_step"].values())  # decode steps only: prefill is compute-bound
    rows = []
    for r in results:
        ours = by_key.get((r.case, "moeserve"))
        tokens_per_step = cfg.prefill_len if r.case == "prefill" else _batch_of(r.case)
        step = _step_bytes(cfg, r, ours, tokens_per_step, per_sequence, (file_bytes or {}).get(r.engine))
        rows.append({"case": r.case, "engine": r.engine, **_speed_fields(r, step, bandwidths, tokens_per_step),
                     **_memory_fields(r, load_rss), **_traffic_fields(r, step, tokens_per_step),
                     # how many times faster moeserve is than this engine, paired run by run
                     "moeserve_speedup": paired_ratio(ours, r) if ours and r is not ours else None})
    return {"shape": cfg.shape.name, "checkpoint": str(cfg.checkpoint), "machine": machine,
            "bandwidths": bandwidths, "settings": _settings(cfg), "rows": rows, "sequence_memory": seq_memory,
            "skipped": [{"engine": s.engine, "reason": s.reason} for s in skipped]}


def _step_bytes(cfg: BenchConfig, r: CaseResult, ours: CaseResult | None, tokens_per_step: int,
                per_sequence: float, from_file: tuple[float, float] | None = None) -> ceilings.StepBytes:
    """Bytes one step of `r`'s engine reads: dense weights, experts from fast memory and disk, sequence memory;
    `from_file`: the engine's (dense, expert) bytes per parameter read from its weight file."""
    # moeserve and its variants: their own store counters; other engines: moeserve's (same model and cache)
    # moeserve's counters summed over all runs: every engine's runs see the same prompts (and, with a route
    # trace, the same trace tokens), where one run each would compare different stretches of the routing
    ref_run = _summed_run(r) if r.engine.startswith("moeserve") or not ours else _summed_run(ours)
    quantized = r.engine.startswith("moeserve") and cfg.quantization != "none"  # moeserve peers quantize alike
    engine_key = f"moeserve-{cfg.quantization}" if quantized else r.engine
    bpp = from_file or BYTES_PER_PARAM.get(engine_key, BYTES_PER_PARAM.get(r.engine, (2.0, 2.0)))
    store = ref_run.get("store") or {}
    dense = dense_bytes(cfg, r.engine, engine_key, bpp, tokens_per_step)
    if store:
        step = step_bytes_from_store(cfg, bpp, tokens_per_step, store, int(ref_run["steps"]), dense)
    else:
        step = ceilings.resident_step_bytes(cfg.shape, bpp[1], tokens_per_step)
    sequence = 0 if r.case == "prefill" else tokens_per_step * per_sequence
    return ceilings.StepBytes(dense, step.expert_bytes_fast, step.expert_bytes_disk, sequence)


def _speed_fields(r: CaseResult, step: ceilings.StepBytes, bandwidths: dict[str, float],
                  tokens_per_step: int) -> dict[str, Any]:
    """tokens/s and its fraction of the ceiling: each run against the ceiling of the memory bandwidth probed right
    before its round (runner.run_cases), the row giving the medians; without such probes (older JSON), the best
    probe of before and after."""
    disk_bw = bandwidths["disk_bytes_per_s"]
    best_ceiling = ceilings.tokens_per_second_ceiling(step, bandwidths["memory_bytes_per_s"], disk_bw,
                                                      tokens_per_step)
    tps = r.median_tokens_per_s
    timed = [run for run in r.runs if run["seconds"] > 0]
    if timed and all(run.get("memory_bytes_per_s") for run in timed):
        beside = [ceilings.tokens_per_second_ceiling(step, run["memory_bytes_per_s"], disk_bw, tokens_per_step)
                  for run in timed]
        ceiling = statistics.median(beside)
        fraction = statistics.median(run["tokens"] / run["seconds"] / c for run, c in zip(timed, beside))
    else:
        ceiling, fraction = best_ceiling, ceilings.fraction_of_ceiling(tps, best_ceiling)
    return {
        "tokens_per_s": tps, "runs_tokens_per_s": r.tokens_per_s,
        "runs_memory_bytes_per_s": [run.get("memory_bytes_per_s") for run in r.runs],
        "runs_load_average": [run.get("load_average") for run in r.runs],
        "ceiling_tokens_per_s": ceiling, "fraction_of_ceiling": fraction,
        # against the better memory probe of before and after the whole run (another moment than the runs)
        "best_probe_ceiling_tokens_per_s": best_ceiling,
        "fraction_of_best_probe_ceiling": ceilings.fraction_of_ceiling(tps, best_ceiling),
    }


def _memory_fields(r: CaseResult, load_rss: dict[str, int]) -> dict[str, Any]:
    return {
        "runs_store": [run.get("store") for run in r.runs],
        "peak_rss_bytes": max(run["peak_rss_bytes"] for run in r.runs),
        # with --memory-limit-gb: the most its cgroup held at once, page cache included (None: no limit)
        "memory_peak_bytes": max((run.get("cgroup_peak_bytes") or 0 for run in r.runs), default=0) or None,
        "load_peak_rss_bytes": load_rss.get(r.engine),
    }


def _traffic_fields(r: CaseResult, step: ceilings.StepBytes, tokens_per_step: int) -> dict[str, Any]:
    """Bytes per token by tier and the expert hit rate, measured by moeserve's store (None for peers)."""
    mine = _summed_run(r).get("store") or {}
    accesses = mine.get("hits", 0) + mine.get("misses", 0)
    tokens = sum(run["tokens"] for run in r.runs)
    return {
        "expert_hit_rate": (mine.get("hits", 0) / accesses) if accesses else None,
        "bytes_per_token_memory": step.fast_bytes / tokens_per_step,
        "sequence_bytes_per_token": step.sequence_bytes / tokens_per_step,
        "bytes_per_token_disk": (mine.get("bytes_from_disk", mine.get("bytes_read", 0)) / tokens) if mine else None,
        "bytes_per_token_host": (mine.get("bytes_from_host", 0) / tokens) if mine else None,
        "prefetched_per_token": (mine.get("prefetched", 0) / tokens) if mine else None,
        # misses read into a bypass buffer, not cached (expert_admission=policy; counted in the misses)
        "bypassed_per_token": (mine.get("bypassed", 0) / tokens) if mine else None,
    }


def _summed_run(r: CaseResult) -> dict[str, Any]:
    """Steps and store counters of all of `r`'s runs added up (the store's: None when the engine has none)."""
    stores = [run.get("store") or {} for run in r.runs]
    return {"steps": sum(run["steps"] for run in r.runs),
            "store": {k: sum(st.get(k, 0) for st in stores) for k in stores[0]} if stores[0] else {}}


def _settings(cfg: BenchConfig) -> dict[str, Any]:
    return {"cases": list(cfg.cases), "peers": list(cfg.peers), "new_tokens": cfg.new_tokens,
            "prompt_len": cfg.prompt_len, "prefill_len": cfg.prefill_len, "repeats": cfg.repeats,
            "expert_cache_gb": cfg.expert_cache_gb, "quantization": cfg.quantization, "threads": cfg.threads,
            "prefetch": cfg.prefetch, "memory_limit_bytes": cfg.memory_limit_bytes,
            "route_trace": None if cfg.route_trace is None else str(cfg.route_trace), "device": cfg.device,
            "cpu_isa": cfg.cpu_isa}


def format_table(summary: dict[str, Any]) -> str:
    """A fixed-width table of the rows, bandwidths and skipped peers."""
    bw = summary["bandwidths"]
    m = summary["machine"]
    beside = [probe for row in summary["rows"] for probe in row.get("runs_memory_bytes_per_s", []) if probe]
    lines = [f"shape {summary['shape']}  |  {m['cpu']}, {m['cores']} cores, torch {m['torch']}",
             f"memory bandwidth {bw['memory_bytes_per_s'] / 1e9:.1f} GB/s, disk read {bw['disk_bytes_per_s'] / 1e9:.2f} "
             "GB/s (best of runs before and after)" + (
                 f"; memory probed beside each round: {min(beside) / 1e9:.1f}-{max(beside) / 1e9:.1f} GB/s "
                 "('ceiling' and 'of ceil': medians of each run against its round's probe; 'of best': against the "
                 "best probe)" if beside else "")]
    lines += sequence_lines(summary.get("sequence_memory"))
    limit = summary["settings"].get("memory_limit_bytes")
    if limit:
        lines.append(f"each engine in a memory cgroup of {limit / 2**30:.1f} GiB, page cache included (a machine with "
                     "that much memory); 'charged': the most its cgroup held at once")
    if summary["settings"].get("cpu_isa", "auto") != "auto":
        lines.append(f"moeserve's C++ kernels built for cpu_isa={summary['settings']['cpu_isa']} (its variants' too)")
    if summary["settings"].get("device", "cpu") != "cpu":
        lines.append(f"moeserve on {summary['settings']['device']} (GPU slots <- RAM <- disk); the ceilings above are "
                     "the CPU's memory and the disk's, not the GPU's")
    if summary["settings"].get("route_trace"):
        lines.append(f"ROUTING FORCED BY THE TRACE {summary['settings']['route_trace']} (benchmark only: moeserve's "
                     "experts follow it, through the per-op layer pass)")
    header = (f"{'case':<10} {'engine':<26} {'tok/s':>8} {'ceiling':>8} {'of ceil':>7} {'of best':>7} {'ours/it':>7} "
              f"{'peak RSS':>9} {'charged':>9} {'hit rate':>8} {'MB/tok mem':>10} {'MB/tok disk':>11} {'MB/tok host':>11}")
    lines += [header, "-" * len(header)]
    for row in summary["rows"]:
        lines.append(_format_row(row))
    lines += unbounded_notes(summary)
    for s in summary["skipped"]:
        lines.append(f"skipped {s['engine']}: {s['reason']}")
    return "\n".join(lines)


def sequence_lines(seq: dict[str, Any] | None) -> list[str]:
    """What a decode step reads and writes of one sequence's memory (in every decode ceiling), and MLA's KV per
    token beside full KV."""
    if not seq:
        return []
    parts = ", ".join(f"{kind} {nbytes / 1e6:.3f} MB" for kind, nbytes in seq["bytes_per_step"].items())
    lines = [f"sequence memory read+written per decode step and sequence at {seq['context_tokens']} tokens of "
             f"context (in 'ceiling'): {parts or 'none'}"]
    if seq.get("kv_per_token"):
        lines.append(f"KV per token: {seq['kv_per_token']}")
    return lines


def _format_row(row: dict[str, Any]) -> str:
    hit = "-" if row["expert_hit_rate"] is None else f"{row['expert_hit_rate']:.1%}"
    vs = "-" if row["moeserve_speedup"] is None else f"{row['moeserve_speedup']:.2f}x"
    mb = {k: "-" if row.get(k) is None else f"{row[k] / 1e6:.1f}" for k in ("bytes_per_token_disk",
                                                                            "bytes_per_token_host")}
    charged = "-" if not row.get("memory_peak_bytes") else f"{row['memory_peak_bytes'] / 2**20:.0f}Mi"
    return (f"{row['case']:<10} {row['engine']:<26} {row['tokens_per_s']:>8.2f} {row['ceiling_tokens_per_s']:>8.1f} "
            f"{row['fraction_of_ceiling']:>7.0%} {row['fraction_of_best_probe_ceiling']:>7.0%} {vs:>7} "
            f"{row['peak_rss_bytes'] / 2**20:>7.0f}Mi {charged:>9} {hit:>8} "
            f"{row['bytes_per_token_memory'] / 1e6:>10.1f} {mb['bytes_per_token_disk']:>11} "
            f"{mb['bytes_per_token_host']:>11}")


def unbounded_notes(summary: dict[str, Any]) -> list[str]:
    """One line per engine whose run the memory limit did not bound: its peak RSS above the limit, or far above
    what its cgroup was charged (pages it maps are charged elsewhere, e.g. a file another process left in the page
    cache). Without a limit, one line saying every run was unbounded."""
    limit = summary["settings"].get("memory_limit_bytes")
    if not limit:
        return ["no memory limit: every engine could use the whole machine (peak RSS shown; --memory-limit-gb "
                "bounds each, page cache included)"] if summary["rows"] else []
    notes = []
    for row in summary["rows"]:
        rss, charged = row["peak_rss_bytes"], row.get("memory_peak_bytes") or 0
        # slack: shared libraries the parent already read count in RSS, charged to the parent (~0.5 GiB of torch)
        if rss > limit or rss > charged + max(0.25 * limit, 512 * 2**20):
            notes.append(f"NOT BOUNDED: {row['case']} {row['engine']}: peak RSS {rss / 2**30:.2f} GiB, charged "
                         f"{charged / 2**30:.2f} GiB of a {limit / 2**30:.1f} GiB limit: pages it maps are charged "
                         "elsewhere (left in the page cache by another process?), so the limit did not hold it")
    return notes
