"""Prometheus metrics in the text exposition format, with vLLM's names under the `moeserve:` prefix; the ones that
mean what vLLM's mean are exposed under vLLM's own `vllm:` names too (VLLM_NAMES), so its dashboards work as they are.

Gauges (requests running / waiting) and expert-cache counters are read at scrape time from the engine; latency
histograms and token counters are fed by the request handlers. Times are `time.monotonic()` seconds, measured from
the moment the request arrived at the server (so time to first token includes tokenization and queueing).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Iterable
from typing import Any

PREFIX = "moeserve:"
VLLM_PREFIX = "vllm:"
# moeserve family -> its vLLM names (vLLM's docs "Production Metrics"; gpu_cache_usage_perc: the name before v0.10)
VLLM_NAMES: dict[str, tuple[str, ...]] = {
    "num_requests_running": ("num_requests_running",),
    "num_requests_waiting": ("num_requests_waiting",),
    "kv_cache_usage_perc": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
    "prompt_tokens_total": ("prompt_tokens_total",),
    "generation_tokens_total": ("generation_tokens_total",),
    "request_success_total": ("request_success_total",),
    "time_to_first_token_seconds": ("time_to_first_token_seconds",),
    "inter_token_latency_seconds": ("inter_token_latency_seconds",),
    "e2e_request_latency_seconds": ("e2e_request_latency_seconds",),
    "num_preemptions_total": ("num_preemptions_total",),
    "prefix_cache_queries_total": ("prefix_cache_queries_total",),
    "prefix_cache_hits_total": ("prefix_cache_hits_total",),
}
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0)


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    body = ",".join(f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34)).replace(chr(10), chr(92) + "n")}"'
                    for k, v in sorted(labels.items()))
    return "{" + body + "}"


def _fmt(value: float) -> str:
    return repr(float(value)) if value != int(value) else f"{int(value)}.0"


class Histogram:
    """Cumulative buckets, sum and count (one label set)."""

    def __init__(self, name: str, doc: str, buckets: Iterable[float]) -> None:
        self.name, self.doc = PREFIX + name, doc
        self.bounds = list(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # last = +Inf
        self.total = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self.counts[bisect.bisect_left(self.bounds, value)] += 1
            self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def render(self, labels: dict[str, str]) -> list[str]:
        lines = [f"# HELP {self.name} {self.doc}", f"# TYPE {self.name} histogram"]
        with self._lock:
            cumulative = 0
            for bound, n in zip([*self.bounds, float("inf")], self.counts):
                cumulative += n
                le = "+Inf" if bound == float("inf") else _fmt(bound)
                lines.append(f"{self.name}_bucket{_labels({**labels, 'le': le})} {cumulative}")
            lines.append(f"{self.name}_sum{_labels(labels)} {_fmt(self.total)}")
            lines.append(f"{self.name}_count{_labels(labels)} {cumulative}")
        return lines


class Counter:
    """A monotonically increasing count, optionally split by one label."""

    def __init__(self, name: str, doc: str, label: str | None = None) -> None:
        self.name, self.doc, self.label = PREFIX + name, doc, label
        self.values: dict[str, float] = {}
        self._lock = threading.Lock()

    def inc(self, amount: float = 1.0, label_value: str = "") -> None:
        with self._lock:
            self.values[label_value] = self.values.get(label_value, 0.0) + amount

    def get(self, label_value: str = "") -> float:
        return self.values.get(label_value, 0.0)

    def render(self, labels: dict[str, str]) -> list[str]:
        lines = [f"# HELP {self.name} {self.doc}", f"# TYPE {self.name} counter"]
        with self._lock:
            items = sorted(self.values.items())
        if not items and self.label is None:
            items = [("", 0.0)]
        for value_label, value in items:
            extra = {self.label: value_label} if self.label else {}
            lines.append(f"{self.name}{_labels({**labels, **extra})} {_fmt(value)}")
        return lines


def _gauge(name: str, doc: str, value: float, labels: dict[str, str], kind: str = "gauge") -> list[str]:
    full = PREFIX + name
    return [f"# HELP {full} {doc}", f"# TYPE {full} {kind}", f"{full}{_labels(labels)} {_fmt(value)}"]


class ServerMetrics:
    """Everything /metrics shows. `engine` is the AsyncEngine (read at scrape time)."""

    def __init__(self, model_name: str) -> None:
        self.labels = {"model_name": model_name}
        self.ttft = Histogram("time_to_first_token_seconds", "Time from arrival to the first token.", TTFT_BUCKETS)
        self.itl = Histogram("inter_token_latency_seconds", "Time between successive output tokens.", ITL_BUCKETS)
        self.e2e = Histogram("e2e_request_latency_seconds", "Time from arrival to the last token.", E2E_BUCKETS)
        self.prompt_tokens = Counter("prompt_tokens_total", "Prompt tokens of finished requests.")
        self.generation_tokens = Counter("generation_tokens_total", "Generated tokens of finished requests.")
        self.request_success = Counter("request_success_total", "Finished requests by finish reason.",
                                       label="finished_reason")
        self.rejected = Counter("request_rejected_total", "Requests refused with a 4xx/5xx status, by reason.",
                                label="reason")
        self.tokens_streamed = 0  # every token as it is produced (the periodic log's throughput)

    def request_timer(self) -> RequestTimer:
        return RequestTimer(self)

    def render(self, engine: Any) -> str:
        lines: list[str] = []
        running = getattr(engine, "num_running", 0) if engine is not None else 0
        waiting = getattr(engine, "num_waiting", 0) if engine is not None else 0
        lines += _gauge("num_requests_running", "Requests in the running batch.", running, self.labels)
        lines += _gauge("num_requests_waiting", "Requests waiting for a batch slot.", waiting, self.labels)
        for metric in (self.ttft, self.itl, self.e2e):
            lines += metric.render(self.labels)
        for counter in (self.prompt_tokens, self.generation_tokens, self.request_success, self.rejected):
            lines += counter.render(self.labels)
        lines += _expert_lines(engine, self.labels)
        lines += _placement_lines(engine, self.labels)
        lines += _sequence_memory_lines(engine, self.labels)
        lines += _choice_lines(engine, self.labels)
        return "\n".join(lines + vllm_lines(lines)) + "\n"


def _family(line: str) -> str | None:
    """The VLLM_NAMES family a line of ours belongs to (HELP, TYPE or a sample, histogram series too), or None."""
    name = line.split(" ")[2] if line.startswith("#") else line.split("{")[0].split(" ")[0]
    if not name.startswith(PREFIX):
        return None
    base = name[len(PREFIX):]
    if base in VLLM_NAMES:
        return base
    stem = next((base[:-len(s)] for s in _HISTOGRAM_SUFFIXES if base.endswith(s)), None)
    return stem if stem in VLLM_NAMES else None


def vllm_lines(lines: list[str]) -> list[str]:
    """Our lines of the VLLM_NAMES families again under each vLLM name (the same values, labels and types)."""
    out: list[str] = []
    for alias_index in range(max(len(v) for v in VLLM_NAMES.values())):
        for line in lines:
            family = _family(line)
            if family is None or alias_index >= len(VLLM_NAMES[family]):
                continue
            ours, theirs = PREFIX + family, VLLM_PREFIX + VLLM_NAMES[family][alias_index]
            out.append(line.replace(ours, theirs, 1))
    return out


def _choice_lines(engine: Any, labels: dict[str, str]) -> list[str]:
    """Every start-up choice as an info-style gauge (value 1): what the engine chose and why, by name."""
    choices = engine.startup_choices()
    if not choices:
        return []
    name = "moeserve:startup_choice"
    lines = [f"# HELP {name} A choice made at start-up (name, and the value with its reason as logged).",
             f"# TYPE {name} gauge"]
    return lines + [f"{name}{_labels({**labels, 'name': k, 'value': v})} 1" for k, v in choices.items()]


def _sequence_memory_lines(engine: Any, labels: dict[str, str]) -> list[str]:
    """The paged KV cache (engine/scheduler.py, state/manager.py): blocks, preemptions, prefix cache, prefill."""
    stats = engine.sequence_memory_stats() if engine is not None else {}
    if not stats:
        return []
    lines = _gauge("kv_cache_usage_perc", "Fraction of KV cache blocks held by sequences (1 = full).",
                   stats["kv_usage"], labels)
    name = PREFIX + "kv_cache_blocks"
    lines += [f"# HELP {name} KV cache blocks, by state.", f"# TYPE {name} gauge",
              f"{name}{_labels({**labels, 'state': 'used'})} {_fmt(stats['kv_blocks_used'])}",
              f"{name}{_labels({**labels, 'state': 'free'})} "
              f"{_fmt(stats['kv_blocks_total'] - stats['kv_blocks_used'])}"]
    for key, metric, doc in (
        ("preemptions", "num_preemptions_total", "Sequences preempted (blocks freed, recomputed later)."),
        ("prefix_queried_tokens", "prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache."),
        ("prefix_hit_tokens", "prefix_cache_hits_total", "Prompt tokens found in the prefix cache."),
        ("prefix_snapshots_saved", "prefix_cache_snapshots_saved_total",
         "Recurrent-state prefix snapshots saved (models with Gated DeltaNet or Mamba-2 layers)."),
        ("prefix_snapshots_restored", "prefix_cache_snapshots_restored_total",
         "Recurrent-state prefix snapshots copied into an admitted sequence's state slot."),
        ("prefill_tokens", "prefill_tokens_total", "Prompt (and recomputed) tokens computed."),
        ("steps", "engine_steps_total", "Engine steps run."),
    ):
        lines += _gauge(metric, doc, stats[key], labels, "counter")
    lines += _gauge("last_step_prefill_tokens", "Prefill tokens in the last engine step (chunked prefill: at most "
                    "max_num_batched_tokens).", stats["last_step_prefill_tokens"], labels)
    return lines


def _placement_lines(engine: Any, labels: dict[str, str]) -> list[str]:
    """The hybrid placement (placement=hybrid or cpu on a GPU machine): expert computations by where they ran, the
    CPU side's time and the costs the chooser weighs now (re-checked as the run goes)."""
    get = getattr(engine, "placement_stats", None)
    found = get() if get is not None else None
    if found is None:
        return []
    stats, costs = found
    name = PREFIX + "expert_placements_total"
    lines = [f"# HELP {name} Routed experts computed, by where: gpu_hit (in a GPU slot), copied (a miss copied to a "
             "GPU slot), cpu (a miss computed by the CPU from host RAM).", f"# TYPE {name} counter"]
    for where, value in (("gpu_hit", stats.gpu_hits), ("copied", stats.copied), ("cpu", stats.cpu)):
        lines.append(f"{name}{_labels({**labels, 'where': where})} {_fmt(value)}")
    lines += _gauge("expert_cpu_side_seconds_total", "Wall seconds of the hybrid placement's CPU side.",
                    stats.cpu_seconds, labels, "counter")
    name = PREFIX + "expert_placement_cost"
    lines += [f"# HELP {name} The placement chooser's costs now (bytes/s or flop/s; {costs.source}).",
              f"# TYPE {name} gauge"]
    for kind in ("h2d_bytes_per_s", "host_read_bytes_per_s", "hbm_bytes_per_s", "cpu_flops", "gpu_flops"):
        lines.append(f"{name}{_labels({**labels, 'kind': kind})} {_fmt(getattr(costs, kind))}")
    return lines


def _expert_lines(engine: Any, labels: dict[str, str]) -> list[str]:
    """Expert-cache counters from the store (absent while loading or for engines without a store)."""
    store = engine.expert_store()
    if store is None:
        return []
    layer_stats = list(store.stats.layers.values())  # a copy: the engine thread may add layers meanwhile

    def total(name: str) -> int:
        return sum(getattr(s, name, 0) for s in layer_stats)

    fast_tier = getattr(getattr(store, "device", None), "type", "device")
    lines: list[str] = []
    lines += _gauge("expert_cache_hits_total", "Expert lookups served from the fast-tier cache.", total("hits"),
                    labels, "counter")
    lines += _gauge("expert_cache_misses_total", "Expert lookups that had to load from a slower tier.",
                    total("misses"), labels, "counter")
    name = PREFIX + "expert_bytes_loaded_total"
    lines += [f"# HELP {name} Expert bytes loaded into the fast tier, by the tier they came from.",
              f"# TYPE {name} counter"]
    for tier in ("host", "disk"):
        lines.append(f"{name}{_labels({**labels, 'tier': tier})} {_fmt(total('bytes_from_' + tier))}")
    name = PREFIX + "expert_cache_capacity_bytes"
    lines += [f"# HELP {name} Bytes of expert slots, by tier.", f"# TYPE {name} gauge",
              f"{name}{_labels({**labels, 'tier': fast_tier})} {_fmt(store.cache_nbytes)}"]
    host_bytes = getattr(store, "host_nbytes", 0)
    if host_bytes:
        lines.append(f"{name}{_labels({**labels, 'tier': 'host'})} {_fmt(host_bytes)}")
    lines += _gauge("expert_prefetched_total", "Expert units loaded ahead of a predicted use.", total("prefetched"),
                    labels, "counter")
    decision = store.prefetch_decision() if hasattr(store, "prefetch_decision") else None
    if decision is not None:  # prefetch=auto: whether it reads now, and why (experts/prefetch/auto.py)
        lines += _gauge("expert_prefetch_enabled", "prefetch=auto: 1 while predicted experts are read (the reason as "
                        "logged).", float(decision[0]), {**labels, "reason": decision[1]})
    lines += _gauge("expert_load_errors_total", "Expert reads from a slower tier that failed (unreadable, or "
                    "bytes that differ from their first read).", store.stats.load_errors, labels, "counter")
    verifier = getattr(getattr(store, "loader", None), "verifier", None)
    if verifier is not None:
        lines += _gauge("expert_units_bad", "Expert units that failed verification: requests that need them fail "
                        "(500) and /health says degraded.", len(verifier.bad), labels)
    return lines


class RequestTimer:
    """Latency bookkeeping of one request: feed it each output's new-token count, then finish()."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.arrival = time.monotonic()
        self.last_token_time: float | None = None

    def on_tokens(self, num_new: int) -> None:
        if num_new <= 0:
            return
        now = time.monotonic()
        self.metrics.tokens_streamed += num_new
        if self.last_token_time is None:
            self.metrics.ttft.observe(now - self.arrival)
        else:
            self.metrics.itl.observe(now - self.last_token_time)
        self.last_token_time = now

    def finish(self, prompt_tokens: int, generation_tokens: int, finish_reasons: Iterable[str | None]) -> None:
        self.metrics.e2e.observe(time.monotonic() - self.arrival)
        self.metrics.prompt_tokens.inc(prompt_tokens)
        self.metrics.generation_tokens.inc(generation_tokens)
        for reason in finish_reasons:
            self.metrics.request_success.inc(1, reason or "abort")


class StatsLogger:
    """One log line every `interval_s` while the server is busy: load, throughput, expert-cache behaviour."""

    def __init__(self, metrics: ServerMetrics, engine: Any, interval_s: float = 10.0) -> None:
        self.metrics, self.engine, self.interval_s = metrics, engine, interval_s
        self._last = (time.monotonic(), 0, 0, 0)  # time, tokens, expert hits, expert misses

    def line(self) -> str | None:
        """The line for the period since the previous call, or None if nothing happened."""
        now = time.monotonic()
        store = self.engine.expert_store()
        layer_stats = list(store.stats.layers.values()) if store is not None else []
        hits = sum(s.hits for s in layer_stats)
        misses = sum(s.misses for s in layer_stats)
        tokens = self.metrics.tokens_streamed
        t0, tokens0, hits0, misses0 = self._last
        self._last = (now, tokens, hits, misses)
        running, waiting = self.engine.num_running, self.engine.num_waiting
        if tokens == tokens0 and not running and not waiting:
            return None
        lookups = (hits - hits0) + (misses - misses0)
        rate = f"{100 * (hits - hits0) / lookups:.1f}%" if lookups else "n/a"
        return (f"engine: {running} running, {waiting} waiting; generation {(tokens - tokens0) / (now - t0):.1f} "
                f"tok/s; expert cache hit rate {rate} ({misses - misses0} misses)")
