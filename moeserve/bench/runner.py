"""The benchmark run: probes, then each case on moeserve and its peers alternately (A B A B), then the ceilings.

Cases: "decode-b1" (one sequence), "decode-b8" (eight sequences decoded together), "prefill" (one prompt).
Repeats alternate engines so that drift of a shared machine hits every engine alike; a ratio between two
engines is the median of the ratios of adjacent runs.
"""

from __future__ import annotations

import logging
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moeserve.bench import ceilings, memlimit
from moeserve.bench.shape_base import Shape
from moeserve.bench.worker import BenchWorkerError, Worker
from moeserve.errors import MoeserveError
from moeserve.memory import pagecache, probes

log = logging.getLogger("moeserve.bench")

CASES = ("decode-b1", "decode-b8", "prefill")
# moeserve against itself with one setting changed (the gain of prefetch, the C++ kernels, the interleaved layout,
# the fused decode step, admission control; the cost of batch invariance)
SELF_PEERS: dict[str, dict[str, Any]] = {
    "moeserve-no-prefetch": {"prefetch": False}, "moeserve-torch-kernels": {"kernels": "torch"},
    "moeserve-plain-experts": {"expert_layout": "plain"}, "moeserve-per-op": {"decode_step": "per_op"},
    "moeserve-batch-variant": {"batch_invariant": False}, "moeserve-lru": {"cache_policy": "lru"},
    "moeserve-prefetch": {"prefetch": True}, "moeserve-prefetch-auto": {"prefetch": "auto"},
    "moeserve-admission": {"expert_admission": "policy"},
}
# llama.cpp on a GGUF of the same weights: peer name -> GGUF kind (bench/gguf_export.py)
LLAMA_PEERS = {"llama.cpp": "bf16", "llama.cpp-q8": "q8_0", "llama.cpp-q4_0": "q4_0", "llama.cpp-q4_k_m": "q4_k_m"}
PEERS = ("transformers", "accelerate", *LLAMA_PEERS, *SELF_PEERS)


@dataclass(frozen=True)
class BenchConfig:
    shape: Shape
    checkpoint: Path
    cases: tuple[str, ...] = ("decode-b1", "decode-b8", "prefill")
    peers: tuple[str, ...] = ("transformers",)
    new_tokens: int = 32
    prompt_len: int = 32
    prefill_len: int = 256
    repeats: int = 3
    expert_cache_gb: float | None = None
    quantization: str = "none"
    threads: int | None = None
    seed: int = 0
    prefetch: bool | None = None  # None: the engine's default
    # Each engine's process in a memory cgroup of this many bytes, page cache included (bench/memlimit.py): a
    # machine with that much memory. None: no limit.
    memory_limit_bytes: int | None = None
    # BENCHMARK ONLY: moeserve's experts follow this routing trace (bench/route_trace.py); None: its routers
    route_trace: Path | None = None
    device: str = "cpu"  # where moeserve computes ("cuda": GPU slots <- RAM <- disk); peers run on the CPU
    cpu_isa: str = "auto"  # the ISA moeserve's C++ kernels are built for (its cpu_isa setting) and its variants'
    # a GGUF of the shape's weights: moeserve (and its variants) and the llama.cpp peer run on this very file
    gguf: Path | None = None


@dataclass
class CaseResult:
    engine: str
    case: str
    runs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> list[float]:
        return [r["tokens"] / r["seconds"] for r in self.runs if r["seconds"] > 0]

    @property
    def median_tokens_per_s(self) -> float:
        return statistics.median(self.tokens_per_s) if self.runs else 0.0


@dataclass
class Skipped:
    engine: str
    reason: str


def make_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Deterministic random token ids (ids 0-2 left out: they are the synthetic model's special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


def _batch_of(case: str) -> int:
    return int(case.removeprefix("decode-b")) if case.startswith("decode-b") else 1


def start_engines(cfg: BenchConfig, cache_dir: Path) -> tuple[dict[str, Worker], list[Skipped]]:
    """Start moeserve and each available peer in its own process. Unavailable peers are skipped with a reason."""
    workers: dict[str, Worker] = {}
    skipped: list[Skipped] = []
    model = str(cfg.gguf or cfg.checkpoint)
    cache_gb = cfg.expert_cache_gb
    ours: dict[str, Any] = dict(model=model, dtype="bfloat16", expert_cache_gb=cache_gb,
                                quantization=cfg.quantization, threads=cfg.threads, max_num_seqs=8,
                                max_model_len=max(cfg.prefill_len, cfg.prompt_len + cfg.new_tokens) + 8)
    if cfg.route_trace is not None:
        ours["route_trace"] = str(cfg.route_trace)
    if cfg.device != "cpu":
        ours["device"] = cfg.device
    if cfg.cpu_isa != "auto":
        ours["cpu_isa"] = cfg.cpu_isa
    try:
        _start_all(cfg, cache_dir, workers, skipped, ours)
    except BaseException:
        for w in workers.values():
            w.close()
        raise
    return workers, skipped


def drop_inputs(paths: list[Path], engine: str) -> pagecache.DropReport:
    """Drop the bench's files from the page cache before `engine` starts, so it reads its weights into its own
    memory (and cgroup) instead of mapping pages another process left there, uncharged (memory/pagecache.py)."""
    report = pagecache.drop(paths)
    log.info("before %s: %s", engine, report.describe())
    return report


def _start_all(cfg: BenchConfig, cache_dir: Path, workers: dict[str, Worker], skipped: list[Skipped],
               ours: dict[str, Any]) -> None:
    drop_inputs(model_files(cfg), "moeserve")
    workers["moeserve"] = Worker("moeserve", cgroup=_cgroup(cfg, "moeserve"), **ours,
                                 **({} if cfg.prefetch is None else {"prefetch": cfg.prefetch}))
    for peer in cfg.peers:
        if peer in SELF_PEERS:  # moeserve against itself with one setting changed: that setting's gain, paired
            keep_prefetch = {} if cfg.prefetch is None or "prefetch" in SELF_PEERS[peer] else {"prefetch": cfg.prefetch}
            drop_inputs(model_files(cfg), peer)
            try:  # a setting this build does not have (e.g. prefetch=auto) skips the variant, with the reason
                workers[peer] = Worker("moeserve", cgroup=_cgroup(cfg, peer), **ours, **SELF_PEERS[peer],
                                       **keep_prefetch)
            except BenchWorkerError as err:
                skipped.append(Skipped(peer, str(err).splitlines()[0]))
                log.warning("peer %s skipped: %s", peer, skipped[-1].reason)
            continue
        if cfg.route_trace is not None:
            skipped.append(Skipped(peer, "routes by its own router: not comparable under --route-trace"))
            log.warning("peer %s skipped: it routes by its own router, not by --route-trace", peer)
            continue
        if cfg.device != "cpu":
            skipped.append(Skipped(peer, f"runs on the CPU here: not comparable with --device {cfg.device}"))
            log.warning("peer %s skipped: it runs on the CPU, moeserve on %s", peer, cfg.device)
            continue
        try:
            drop_inputs(model_files(cfg), peer)  # the GGUF too: _start_peer drops it after writing it
            workers[peer] = _start_peer(peer, cfg, cache_dir)
        except (ImportError, MoeserveError, OSError) as err:  # a GGUF of an architecture it cannot write: ConfigError
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            skipped.append(Skipped(peer, reason))
            log.warning("peer %s skipped: %s", peer, reason)


def model_files(cfg: BenchConfig) -> list[Path]:
    """What the engines read: the shape's checkpoint, and the GGUF of --gguf."""
    return [cfg.checkpoint] + ([cfg.gguf] if cfg.gguf is not None else [])


def _cgroup(cfg: BenchConfig, engine: str) -> memlimit.MemoryCgroup | None:
    """The memory cgroup of one engine's process (its own, same limit for all), or None without a limit."""
    if cfg.memory_limit_bytes is None:
        return None
    return memlimit.create(cfg.memory_limit_bytes, f"moeserve-bench-{os.getpid()}-{engine.replace('.', '_')}")


def _start_peer(peer: str, cfg: BenchConfig, cache_dir: Path) -> Worker:
    import importlib.util

    model = str(cfg.checkpoint)
    if peer == "transformers":
        if importlib.util.find_spec("transformers") is None:
            raise ImportError("transformers is not installed (pip install 'moeserve[dev]')")
        return Worker("transformers", cgroup=_cgroup(cfg, peer), model=model, threads=cfg.threads)
    if peer == "accelerate":
        if importlib.util.find_spec("accelerate") is None:
            raise ImportError("accelerate is not installed (pip install 'moeserve[dev]')")
        offload = offload_dir(cfg, cache_dir)
        # The same fast-tier budget moeserve has: non-expert weights plus the expert cache.
        dense = ceilings.dense_bytes_per_step(cfg.shape, 2) + cfg.shape.vocab_size * cfg.shape.hidden_size * 2
        cache = int((cfg.expert_cache_gb or 0) * 2**30)
        return Worker("transformers", cgroup=_cgroup(cfg, peer), model=model, threads=cfg.threads,
                      offload_folder=str(offload),
                      max_cpu_memory_bytes=dense + cache)
    if peer in LLAMA_PEERS:
        if importlib.util.find_spec("llama_cpp") is None:
            raise ImportError("llama-cpp-python is not installed (optional: pip install 'moeserve[llamacpp]', "
                              "which compiles llama.cpp, ~7 minutes)")
        from moeserve.bench.gguf_export import ensure_gguf

        path = cfg.gguf or ensure_gguf(cfg.checkpoint, cfg.shape, LLAMA_PEERS[peer])
        drop_inputs([path], peer)  # read by an earlier run: its pages may be charged to this process, not the peer
        return Worker("llama.cpp", cgroup=_cgroup(cfg, peer), gguf_path=str(path), threads=cfg.threads,
                      n_ctx=max(cfg.prefill_len, cfg.prompt_len + cfg.new_tokens) + 8)
    raise ValueError(f"unknown peer {peer!r} (valid: {', '.join(PEERS)})")


def offload_dir(cfg: BenchConfig, cache_dir: Path) -> Path:
    """Where this run's accelerate peer offloads weights (removed when the run ends)."""
    return cache_dir / f"offload-{cfg.shape.name}-{os.getpid()}"


def run_cases(cfg: BenchConfig, workers: dict[str, Worker],
              probe: Callable[[], float] = probes.memory_bandwidth) -> list[CaseResult]:
    """Each case, `repeats` times, engines alternating. One untimed warm-up per engine and case first.

    Before each timed round the memory bandwidth is probed (`probe`, bytes/s) and kept with every run of the
    round: a shared machine's bandwidth moves by 1.5x within minutes, so each run is set against the ceiling
    measured right beside it (see report.summarize), as engines are against each other."""
    results = {(name, case): CaseResult(name, case) for name in workers for case in cfg.cases}
    for case in cfg.cases:
        batch = _batch_of(case)
        for rep in range(-1, cfg.repeats):  # rep -1 is the warm-up
            bandwidth = probe() if rep >= 0 else 0.0
            for name, w in workers.items():
                if case == "prefill":
                    prompt = make_prompts(1, cfg.prefill_len, cfg.shape.vocab_size, cfg.seed + 1000 + rep)[0]
                    args: tuple[Any, ...] = ("prefill", prompt)
                else:
                    prompts = make_prompts(batch, cfg.prompt_len, cfg.shape.vocab_size, cfg.seed + rep)
                    args = ("decode", prompts, cfg.new_tokens if rep >= 0 else 2)
                try:
                    run = w.call(*args)
                except BenchWorkerError as err:  # e.g. a peer without batched decode: skip it for this case
                    log.warning("%s %s: %s", name, case, err)
                    continue
                if rep >= 0:
                    run["memory_bytes_per_s"] = bandwidth
                    run["load_average"] = os.getloadavg()[0]  # 1-minute, after the run: how shared the machine was
                    results[(name, case)].runs.append(run)
                    log.info("%s %s run %d/%d: %.2f tokens/s", case, name, rep + 1, cfg.repeats,
                             run["tokens"] / max(run["seconds"], 1e-12))
    return [r for r in results.values() if r.runs]


def paired_ratio(a: CaseResult, b: CaseResult) -> float | None:
    """Median over repeats of (a tokens/s) / (b tokens/s), pairing the runs made next to each other (the
    i-th run of every engine is made in the same round), so slow drift of the machine cancels in each pair."""
    pairs = list(zip(a.tokens_per_s, b.tokens_per_s))
    return statistics.median(x / y for x, y in pairs) if pairs and all(y > 0 for _, y in pairs) else None


def machine_info() -> dict[str, Any]:
    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    return {"cpu": model, "cores": len(os.sched_getaffinity(0)), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "python": platform.python_version(),
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def measure_bandwidths(checkpoint: Path) -> dict[str, float]:
    shards = sorted(checkpoint.glob("*.safetensors"))
    return {"memory_bytes_per_s": probes.memory_bandwidth(),
            "disk_bytes_per_s": probes.disk_read_bandwidth(shards)}
