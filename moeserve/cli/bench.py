"""`moeserve bench`: build a synthetic model (cached), probe the machine, time moeserve and its peers side by side;
`moeserve bench VARIANT` runs one of the other benchmarks (moeserve/bench/variants/)."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import shutil
from pathlib import Path

from moeserve.bench.shape_base import Shape
from moeserve.errors import ConfigError

log = logging.getLogger("moeserve.bench")


def register(sub: argparse._SubParsersAction) -> None:
    from moeserve.bench.runner import CASES, PEERS
    from moeserve.bench.shapes import SHAPES

    p = sub.add_parser("bench", help="benchmark decode and prefill against the hardware ceiling and peers",
                       description="Build (once, cached) a synthetic model of a named shape, measure memory "
                       "and disk bandwidth, and time moeserve and its peers alternately on the same prompts.")
    shapes = ", ".join(f"{s.name} ({s.purpose})" for s in SHAPES.values())
    p.add_argument("--shape", default="small", choices=list(SHAPES), help=f"model shape: {shapes}")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    p.add_argument("--peers", default=None,
                   help=f"comma-separated, of: {', '.join(PEERS)}; or 'none' (default: transformers,llama.cpp; "
                        "llama.cpp with --gguf)")
    p.add_argument("--tokens", type=int, default=32, help="decode steps timed per run")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens before decode")
    p.add_argument("--prefill-len", type=int, default=256, help="prompt tokens of the prefill case")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per engine and case (after one warm-up)")
    p.add_argument("--expert-cache-gb", type=float, default=None,
                   help="expert cache for moeserve (and accelerate's CPU budget); default per shape")
    p.add_argument("--expert-cache-fraction", type=float, default=None,
                   help="expert cache as a fraction of all the shape's experts (e.g. 0.25); instead of --expert-cache-gb")
    p.add_argument("--route-trace", type=Path, default=None,
                   help="BENCHMARK ONLY: moeserve's experts follow this routing trace (moetrace, JSON lines or a FLAME "
                        "folder; see docs/trace-format.md) instead of the synthetic routers, so the cache sees a real "
                        "model's locality; peers other than moeserve's variants are skipped")
    p.add_argument("--gguf", type=Path, default=None,
                   help="a GGUF of the shape's weights (e.g. quantized by llama-quantize): moeserve and the llama.cpp "
                        "peer both run on this very file (default peers: llama.cpp)")
    p.add_argument("--quantization", default="none", choices=["none", "int8", "int4"],
                   help="moeserve's on-load quantization")
    p.add_argument("--cpu-isa", default="auto", choices=["auto", "avx2", "generic"],
                   help="ISA moeserve's C++ kernels are built for (its cpu_isa setting; peers run as built)")
    p.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=None,
                   help="moeserve's expert prefetch (default: the engine's default)")
    p.add_argument("--threads", type=int, default=None, help="compute threads of every engine (default: all cores)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where moeserve computes (cuda: its experts in GPU slots, then RAM, then disk; peers that "
                        "run on the CPU are skipped); default cpu")
    p.add_argument("--memory-limit-gb", type=float, default=None,
                   help="run each engine in a memory cgroup of this size, page cache included: a machine with that "
                        "much memory, so disk offload really reads the disk (needs a writable cgroup; default: none)")
    p.add_argument("--cache-dir", type=Path, default=None, help="where synthetic models are cached "
                   "(default ~/.cache/moeserve/bench)")
    p.add_argument("--json", type=Path, default=None, help="also write the results as JSON to this file")
    p.add_argument("--build-only", action="store_true", help="build the synthetic model and exit")
    p.set_defaults(func=run)
    _register_variants(p)


def _register_variants(parser: argparse.ArgumentParser) -> None:
    """`moeserve bench VARIANT [flags]`: each variant module of moeserve.bench.variants adds its own parser."""
    from moeserve.bench.variants import VARIANTS

    variants = parser.add_subparsers(dest="bench_variant", metavar="VARIANT", parser_class=type(parser),
                                     title="variants (moeserve bench VARIANT --help)")
    for name in VARIANTS:
        importlib.import_module(f"moeserve.bench.variants.{name}").register(variants)


def _csv(value: str, valid: tuple[str, ...], what: str) -> tuple[str, ...]:
    items = tuple(v.strip() for v in value.split(",") if v.strip() and v.strip() != "none")
    bad = [v for v in items if v not in valid]
    if bad:
        raise ConfigError(f"unknown {what} '{bad[0]}' (valid: {', '.join(valid)})")
    return items


def _limit_bytes(gb: float | None) -> int | None:
    if gb is None:
        return None
    if gb <= 0:
        raise ConfigError(f"--memory-limit-gb must be positive (got {gb})")
    return int(gb * 2**30)


def _cache_gb(args: argparse.Namespace, shape: Shape, default: float | None) -> float | None:
    """--expert-cache-gb, or --expert-cache-fraction of the shape's experts as GiB (whole units, logged), or the
    shape's default."""
    fraction = args.expert_cache_fraction
    if fraction is None:
        return args.expert_cache_gb if args.expert_cache_gb is not None else default
    if args.expert_cache_gb is not None:
        raise ConfigError("give --expert-cache-gb or --expert-cache-fraction, not both")
    if not 0 < fraction <= 1:
        raise ConfigError(f"--expert-cache-fraction must be in (0, 1] (got {fraction})")
    unit = shape.expert_params * 2  # one bf16 unit (the synthetic shapes' fields are 64-byte multiples)
    count = max(1, round(fraction * shape.total_experts))
    log.info("expert cache: %d of %d experts (%.0f%%) = %.3f GiB", count, shape.total_experts,
             100 * count / shape.total_experts, count * unit / 2**30)
    return (count + 0.5) * unit / 2**30  # half a unit over: the engine's floor division keeps `count`


def _check_device(device: str) -> None:
    """--device cuda needs a CUDA device: refused in one line before anything is built."""
    if device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", built without CUDA")
        raise ConfigError(f"--device cuda: no CUDA device available ({build}); run the bench on the CPU "
                          "(--device cpu) or on a machine with a GPU")


def _check_trace(path: Path) -> None:
    """Read --route-trace once here, so a missing or malformed trace is one line before anything is built."""
    from moeserve.bench.route_trace import trace_tokens
    from moeserve.bench.traces import load_trace

    if not path.exists():
        raise ConfigError(f"--route-trace {path}: no such file or folder")
    trace = load_trace(path)
    trace_tokens(trace.header, trace.steps)


def _check_gguf(path: Path, shape: Shape, peers: tuple[str, ...], quantization: str) -> None:
    """--gguf FILE: a GGUF of the shape (its token embedding [vocab, hidden] says so), no setting that would make
    moeserve or llama.cpp read other weights. One line each, before anything starts."""
    from moeserve.bench.runner import LLAMA_PEERS
    from moeserve.checkpoint.gguf.header import read_header

    if not path.is_file():
        raise ConfigError(f"--gguf {path}: no such file")
    if quantization != "none":
        raise ConfigError(f"--gguf runs moeserve on the file's own types: --quantization {quantization} does not apply")
    others = [p for p in peers if p in LLAMA_PEERS and p != "llama.cpp"]
    if others:
        raise ConfigError(f"--gguf: llama.cpp runs on {path.name}; the peer {others[0]} makes its own GGUF (use "
                          "the peer llama.cpp)")
    embd = read_header(path).tensors.get("token_embd.weight")
    want = (shape.vocab_size, shape.hidden_size)
    if embd is None or tuple(embd.shape) != want:
        raise ConfigError(f"--gguf {path.name}: token_embd.weight is {None if embd is None else tuple(embd.shape)}, "
                          f"not the {shape.name} shape's {want} (--shape names the shape the file holds)")


def run(args: argparse.Namespace) -> int:
    from moeserve.bench import report, runner
    from moeserve.bench.shapes import DEFAULT_EXPERT_CACHE_GB, get_shape
    from moeserve.bench.synth import default_cache_dir, ensure_checkpoint

    shape = get_shape(args.shape)
    cases = _csv(args.cases, runner.CASES, "case")
    peers = _csv(args.peers or ("llama.cpp" if args.gguf else "transformers,llama.cpp"), runner.PEERS, "peer")
    if args.gguf is not None:
        _check_gguf(args.gguf, shape, peers, args.quantization)
    if args.tokens < 1 or args.repeats < 1:
        raise ConfigError("--tokens and --repeats must be at least 1")
    _check_device(args.device)
    if args.route_trace is not None:
        _check_trace(args.route_trace)
    cache_dir = args.cache_dir or default_cache_dir()
    log.info("model: synthetic %s (%.2f GB bf16) in %s", shape.name, shape.total_params * 2 / 1e9, cache_dir)
    checkpoint = ensure_checkpoint(shape, cache_dir)
    if args.build_only:
        print(checkpoint)
        return 0
    cache_gb = _cache_gb(args, shape, DEFAULT_EXPERT_CACHE_GB[shape.name])
    cfg = runner.BenchConfig(shape, checkpoint, cases, peers, args.tokens, args.prompt_len, args.prefill_len,
                             args.repeats, cache_gb, args.quantization, args.threads, prefetch=args.prefetch,
                             memory_limit_bytes=_limit_bytes(args.memory_limit_gb), route_trace=args.route_trace,
                             device=args.device, cpu_isa=args.cpu_isa, gguf=args.gguf)
    before = runner.measure_bandwidths(checkpoint)
    workers, skipped = runner.start_engines(cfg, cache_dir)
    try:
        load_rss = {key: w.load_peak_rss_bytes for key, w in workers.items()}
        file_bytes = {key: w.bytes_per_param for key, w in workers.items() if w.bytes_per_param}
        results = runner.run_cases(cfg, workers)
    finally:
        for w in workers.values():
            w.close()
        # accelerate's offload folder holds a copy of the offloaded weights: gigabytes, useless after the run
        shutil.rmtree(runner.offload_dir(cfg, cache_dir), ignore_errors=True)
    after = runner.measure_bandwidths(checkpoint)
    # Best of before and after: the ceiling is what the hardware gives when undisturbed.
    bandwidths = {k: max(before[k], after[k]) for k in before}
    bandwidths.update({f"{k}_before": before[k] for k in before} | {f"{k}_after": after[k] for k in after})
    summary = report.summarize(cfg, results, skipped, bandwidths, runner.machine_info(), load_rss,
                                file_bytes)
    print(report.format_table(summary))
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2))
        log.info("wrote %s", args.json)
    return 0
