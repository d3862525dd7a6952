"""What each eviction policy's bookkeeping costs, in microseconds per layer call, on a routing trace replayed through
the engine's `SlotCache` (demand loading, reads landing at once): the time of the cache calls the store makes under
its lock per layer call (pin, begin_call with its on_hit calls, take_miss_slot with choose_victim / on_evict /
on_insert, finish_read, release), and inside that the policy's own methods. A micro-benchmark, not a test: the
figures depend on the machine and its load; compare policies within one run (they alternate, `--rounds` times).

    .venv/bin/python research/policy_cost.py /work/shared/traces/flame-moe-290m --capacity 128 --rounds 3

`--before REV` adds the default policy as git revision REV had it (experts/policies/lfru.py), as `lfru@REV`, to the
alternation: a before/after figure from one run. `--stack K` replays K consecutive steps side by side as one step of
a model with K times the layers (the same routing with a deeper layer cycle: 48 layers from FLAME's 8 with 6).
"""

from __future__ import annotations

import argparse
import functools
import subprocess
import time
import types
from collections import defaultdict
from collections.abc import Callable, Container, Sequence

from moeserve.bench.simulate import LayerCall, split_bypass
from moeserve.cli.simulate import load_calls
from moeserve.experts.policies import DeferredHits, EvictionPolicy, Key, make_policy
from moeserve.experts.slot_cache import SlotCache

_clock = time.thread_time_ns  # CPU time of this thread: other processes on a loaded machine do not count


def clock_overhead_ns(samples: int = 20000) -> float:
    """The cost of one timed interval with nothing in it (two clock reads), subtracted from every interval."""
    start = _clock()
    for _ in range(samples):
        t = _clock()
        _ = _clock() - t
    return (_clock() - start) / samples


class Timed(EvictionPolicy):
    """Another policy, each call timed (perf_counter_ns) and added up per method."""

    name = "timed"

    def __init__(self, inner: EvictionPolicy, overhead_ns: float) -> None:
        self.inner = inner
        self.overhead_ns = overhead_ns
        self.ns: dict[str, float] = defaultdict(float)
        self.count: dict[str, int] = defaultdict(int)

    def _add(self, method: str, start: int) -> None:
        self.ns[method] += _clock() - start - self.overhead_ns
        self.count[method] += 1

    def begin_layer(self, layer: int) -> None:
        t = _clock()
        self.inner.begin_layer(layer)
        self._add("begin_layer", t)

    def on_hit(self, key: Key) -> None:
        t = _clock()
        self.inner.on_hit(key)
        self._add("on_hit", t)

    def on_insert(self, key: Key, *, prefetched: bool = False) -> None:
        t = _clock()
        self.inner.on_insert(key, prefetched=prefetched)
        self._add("on_insert", t)

    def on_evict(self, key: Key) -> None:
        t = _clock()
        self.inner.on_evict(key)
        self._add("on_evict", t)

    def choose_victim(self, pinned: Container[Key], layers: Container[int] | None = None) -> Key:
        t = _clock()
        try:
            return self.inner.choose_victim(pinned, layers)
        finally:
            self._add("choose_victim", t)


def policy_at(rev: str) -> type[EvictionPolicy]:
    """The default policy's class as git revision `rev` had it (its module run from `git show`)."""
    text = subprocess.run(["git", "show", f"{rev}:moeserve/experts/policies/lfru.py"], capture_output=True, text=True,
                          check=True).stdout
    module = types.ModuleType(f"policies_lfru_at_{rev}")
    exec(compile(text, f"{rev}:moeserve/experts/policies/lfru.py", "exec"), module.__dict__)  # noqa: S102 - our code
    return module.AdaptiveLFRUPolicy


def stacked(steps: Sequence[Sequence[LayerCall]], k: int) -> list[LayerCall]:
    """Every `k` consecutive steps as one step of `k` times the layers (step j's layer l becomes j * span + l)."""
    span = 1 + max(c.layer for step in steps for c in step)
    return [LayerCall(c.layer + j * span, c.expert_ids)
            for t in range(0, len(steps) - k + 1, k) for j in range(k) for c in steps[t + j]]


def replay(calls: Sequence[LayerCall], policy: EvictionPolicy, capacity: int, overhead_ns: float
           ) -> tuple[float, SlotCache]:
    """The store's per-call sequence on `calls` (single chunks: capacity >= any call); total ns spent in it."""
    layers = sorted({c.layer for c in calls})
    cache = SlotCache(capacity, policy, layers)
    total = 0.0
    for call in calls:
        keys = [(call.layer, e) for e in call.expert_ids]
        t = _clock()
        cache.pin(keys)
        for key in cache.begin_call(call.layer, keys):
            cache.take_miss_slot(key)
            cache.finish_read(key)
        cache.release(keys)
        total += _clock() - t - overhead_ns
    return total, cache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--capacity", type=int, default=128)
    ap.add_argument("--policy", default="lru,lfu,lfru,reuse")
    ap.add_argument("--rounds", type=int, default=3, help="replays per policy, alternated; the fastest is printed")
    ap.add_argument("--before", metavar="REV", help="also time the default policy of git revision REV (lfru@REV)")
    ap.add_argument("--stack", type=int, default=1, metavar="K", help="K steps side by side: K times the layers")
    args = ap.parse_args()
    if args.stack < 1:
        ap.error(f"--stack {args.stack}: must be >= 1 (steps side by side)")
    _, steps, _ = load_calls(args.trace)
    calls = stacked(steps, args.stack) if args.stack > 1 else [c for step in steps for c in step]
    names = [split_bypass(p)[0] for p in args.policy.split(",")]
    factories: dict[str, Callable[[], EvictionPolicy]] = {name: functools.partial(make_policy, name) for name in names}
    if args.before:
        factories[f"lfru@{args.before}"] = policy_at(args.before)
    overhead = clock_overhead_ns()
    best: dict[str, tuple[float, Timed, SlotCache]] = {}
    for _ in range(args.rounds):
        for name, factory in factories.items():
            for deferred in (False, True):  # DeferredHits: how the store wraps its policy
                label = name + (" (deferred)" if deferred else "")
                policy = factory()
                total, cache = replay(calls, DeferredHits(policy) if deferred else policy, args.capacity, overhead)
                timed = Timed(factory(), overhead)  # the same replay again, each policy method timed
                replay(calls, DeferredHits(timed) if deferred else timed, args.capacity, overhead)
                if label not in best or total < best[label][0]:
                    best[label] = (total, timed, cache)
    n = len(calls)
    methods = ("begin_layer", "on_hit", "on_insert", "on_evict", "choose_victim")
    print(f"{n} layer calls of {len({c.layer for c in calls})} layers, capacity {args.capacity}; CPU us per layer call (fastest of {args.rounds} rounds; "
          f"clock overhead {overhead:.0f} ns subtracted per interval); policy methods: us per call of that method")
    print(f"{'policy':<26}{'hit rate':>9}{'cache+policy':>13}{'policy':>8}" + "".join(f"{m:>14}" for m in methods))
    for label, (total, timed, cache) in best.items():
        inner = sum(timed.ns.values())
        per_method = [timed.ns[m] / 1e3 / timed.count[m] if timed.count[m] else 0.0 for m in methods]
        print(f"{label:<26}{cache.stats.hit_rate:>9.3f}{total / 1e3 / n:>13.1f}{inner / 1e3 / n:>8.1f}"
              + "".join(f"{x:>14.2f}" for x in per_method))


if __name__ == "__main__":
    main()
