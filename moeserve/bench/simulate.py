"""Replay a routing trace through the eviction policies: the expert store's own `SlotCache`, driven as the store
drives it.

A cache of ``capacity`` experts over all MoE layers, its slots shared as ``cache_mode`` says (experts/quota.py:
shared, per_layer, mixed). Per layer call (`LayerCall`), as `ExpertStore.experts`:

1. splits the needed experts (unique, ascending) into chunks of at most ``cache.chunk_limit(layer)`` (the capacity,
   or less under a per-layer quota; normally one chunk);
2. per chunk: pins it, ``begin_call`` (``policy.begin_layer``, the cached keys counted as hits and told to the
   policy), then each miss in order takes a slot (free, or ``policy.choose_victim(pinned)``'s) and lands;
3. optionally prefetches the experts expected in the NEXT layer call while this one is pinned (only when the
   call was one chunk): the guesses already cached are protected, the others read while a slot is free or held
   by a key neither pinned nor protected, so a prefetch never evicts what it predicted. A prefetch is a read,
   not a hit or a miss. Then the pins are released.

``hit_rate = hits / (hits + misses)`` over needed (layer, expert) uses, one per layer call (not per token).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from itertools import product
from typing import Any

import numpy as np

from moeserve.errors import ConfigError
from moeserve.experts.calls import (
    LayerCall,
    calls_from_steps,
    static_reserve,
    usage_counts,
)
from moeserve.experts.policies import ONLINE_POLICY_NAMES, Key, make_policy
from moeserve.experts.prefetch.auto import PrefetchCounts
from moeserve.experts.prefetch.guess import OnlineGuesses
from moeserve.experts.quota import DEFAULT_CACHE_MODE, make_quota
from moeserve.experts.slot_cache import SlotCache

__all__ = [
    "BYPASS_SUFFIX", "PREFETCH_MODES", "GridResult", "LayerCall", "OnlinePrefetch", "SimResult", "affinity_predictions",
    "calls_from_steps", "layer_only", "per_expert_calls", "run_grid", "simulate", "split_bypass", "static_reserve", "usage_counts",
]

# none: demand loading only. oracle: the next layer call's exact experts (an upper bound). predicted: the
# predictions recorded in the trace. affinity: a layer-to-next-layer co-occurrence table fitted on the
# warm-up part of the trace and then frozen (`affinity_predictions`). online: the store's own guesses
# (`OnlineGuesses`, moeserve/experts/prefetch/guess.py: an AffinityPredictor learning as the trace replays, after the
# warm-up part if any, and the store's read gate), with `OnlinePrefetch`'s settings: what the engine does. auto:
# online, reading only while `PrefetchAuto` (experts/prefetch/auto.py) measures that it pays (the engine's
# prefetch=auto).
PREFETCH_MODES = ("none", "oracle", "predicted", "affinity", "online", "auto")
_ONLINE = ("online", "auto")
# A policy name with this suffix (e.g. "lfru+bypass") in a grid: the policy with admission control, its refused
# misses served uncached (`simulate(admission=True)`; the store's expert_admission=policy).
BYPASS_SUFFIX = "+bypass"


def split_bypass(name: str) -> tuple[str, bool]:
    """A grid's policy name -> (the policy's registry name, admission control on)."""
    if name.endswith(BYPASS_SUFFIX):
        return name[: -len(BYPASS_SUFFIX)], True
    return name, False


@dataclass
class SimResult:
    policy: str
    capacity: int
    prefetch: str
    cache_mode: str = DEFAULT_CACHE_MODE
    hits: int = 0
    misses: int = 0
    prefetched: int = 0  # prefetch reads
    prefetch_used: int = 0  # prefetched keys that were needed before they were evicted
    steps: int = 0  # forward steps (tokens at batch 1) replayed
    auto: str | None = None  # prefetch=auto: its last decision and reason, and how often it switched
    per_layer: dict[int, tuple[int, int]] = field(default_factory=dict)  # layer -> (hits, misses)
    bypassed: int = 0  # admission=True: misses served uncached (in `misses`)

    @property
    def accesses(self) -> int:
        return self.hits + self.misses

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def reads(self) -> int:
        """Experts transferred into the cache: demand misses plus prefetches."""
        return self.misses + self.prefetched

    @property
    def reads_per_step(self) -> float:
        """Experts transferred per forward step (per token at batch 1): multiply by an expert's bytes."""
        return self.reads / self.steps if self.steps else 0.0

    @property
    def prefetch_accuracy(self) -> float | None:
        return self.prefetch_used / self.prefetched if self.prefetched else None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(
            hit_rate=self.hit_rate,
            reads=self.reads,
            reads_per_step=self.reads_per_step,
            prefetch_accuracy=self.prefetch_accuracy,
        )
        return out


@dataclass(frozen=True)
class OnlinePrefetch:
    """Settings of the ``online`` prefetch mode: the store's `OnlineGuesses` learning while the trace replays.

    Every layer call is observed before its loads; once its demand loads are done, up to ``width`` experts of the
    next layer call (None: as many as this call needed, as the store does) with calibrated chance at least
    ``min_prob`` are guessed; the cached ones are protected, the others read while such uncached guesses have
    been used at least ``min_prob`` of the time (the store's read gate). ``history`` is replayed through the
    predictor only (no cache) before the evaluated steps: the past it may learn from.
    """

    num_experts: int
    width: int | None = None
    min_prob: float = 0.0
    history: Sequence[Sequence[LayerCall]] = ()

    def guesses(self, auto: PrefetchCounts | None = None) -> OnlineGuesses:
        """`auto`: the cache's counters, for prefetch=auto (None: always read what passes the gate)."""
        guesses = OnlineGuesses(self.num_experts, self.min_prob, auto=auto)
        for step in self.history:
            for call in step:
                guesses.predictor.observe(call.layer, call.expert_ids)
        return guesses


def per_expert_calls(steps: Sequence[Sequence[LayerCall]]) -> list[list[LayerCall]]:
    """Every layer call split into one call per expert (ascending): a cache that sees single-expert
    requests and pins nothing else. This is the access model of the classic per-access simulators (and of
    the FLAME README's sanity figures); the engine's store pins a layer's whole set instead."""
    return [[LayerCall(c.layer, (e,)) for c in step for e in c.expert_ids] for step in steps]


def layer_only(steps: Sequence[Sequence[LayerCall]], layer: int) -> list[list[LayerCall]]:
    """Only ``layer``'s calls: replaying them models a private per-layer cache."""
    return [[c for c in step if c.layer == layer] for step in steps]


def _chunks(call: LayerCall, cache: SlotCache) -> list[list[Key]]:
    ids, limit = call.expert_ids, cache.chunk_limit(call.layer)
    return [[(call.layer, e) for e in ids[i : i + limit]] for i in range(0, len(ids), limit)]


def simulate(
    steps: Sequence[Sequence[LayerCall]],
    policy: str,
    capacity: int,
    prefetch: str = "none",
    policy_options: dict[str, Any] | None = None,
    online: OnlinePrefetch | None = None,
    cache_mode: str = DEFAULT_CACHE_MODE,
    admission: bool = False,
) -> SimResult:
    """Replay ``steps`` through a fresh, empty cache of ``capacity`` experts managed by ``policy``, its slots
    shared among the layers as ``cache_mode`` says. ``admission``: demand misses the policy does not `admit` are
    served uncached (the store's expert_admission=policy: a bypass buffer).

    ``prefetch="online"`` needs ``online`` (the guesses' settings); "affinity" here means: prefetch
    ``call.predicted``, like "predicted".
    """
    if capacity < 1:
        raise ConfigError(f"capacity={capacity}: the cache must hold at least one expert")
    if prefetch not in PREFETCH_MODES:
        raise ConfigError(f"prefetch={prefetch!r}: choose one of {', '.join(PREFETCH_MODES)}")
    if prefetch in _ONLINE and online is None:
        raise ConfigError(f"prefetch {prefetch!r} needs its settings (OnlinePrefetch)")
    calls = [call for step in steps for call in step]
    # Per call: the next call of the same step (online guesses stay within a forward step).
    next_in_step: list[LayerCall | None] = []
    for step in steps:
        next_in_step.extend([*step[1:], None])
    options = dict(policy_options or {})
    layers = sorted({call.layer for call in calls})
    cache = SlotCache(capacity, None, layers, quota=make_quota(cache_mode, capacity, layers))
    if policy == "belady":
        options["future"] = [chunk for call in calls for chunk in _chunks(call, cache)]
    cache.policy = make_policy(policy, **options)
    guesses = None
    if online is not None and prefetch in _ONLINE:
        guesses = online.guesses(cache.stats if prefetch == "auto" else None)
    for index, call in enumerate(calls):
        if guesses is not None:  # the layer has routed: its experts are known before any load
            guesses.observe(call.layer, call.expert_ids)
        chunks = _chunks(call, cache)
        for chunk in chunks:
            _demand(cache, call.layer, chunk, admission)
            if len(chunks) == 1 and prefetch != "none":
                upcoming: Sequence[Key] = call.predicted
                if prefetch == "oracle":
                    upcoming = _chunks(calls[index + 1], cache)[0] if index + 1 < len(calls) else []
                elif guesses is not None and online is not None:
                    upcoming = _online_guess(guesses, cache, next_in_step[index], online.width or len(chunk))
                _prefetch(cache, chunk, upcoming)
            cache.release(chunk)
    stats = cache.stats
    auto = guesses.auto if guesses is not None else None
    return SimResult(policy=policy, capacity=capacity, prefetch=prefetch, cache_mode=cache_mode,
                     auto=f"{auto.reason} ({auto.switches} switches)" if auto is not None else None,
                     hits=stats.hits, misses=stats.misses, bypassed=stats.bypassed,
                     prefetched=stats.prefetched, prefetch_used=stats.prefetch_used, steps=len(steps),
                     per_layer={layer: (st.hits, st.misses) for layer, st in sorted(stats.layers.items())})


def _demand(cache: SlotCache, layer: int, chunk: list[Key], admission: bool = False) -> None:
    """One chunk's demand loads, as `ExpertStore._acquire` makes them (its reads land at once here).
    `admission`: a miss the policy does not `admit` is served without being cached (the store's bypass)."""
    cache.pin(chunk)
    for key in cache.begin_call(layer, chunk):
        if admission and not cache.admits(key):
            cache.bypass(key)
            continue
        cache.take_miss_slot(key)
        cache.finish_read(key)


def _online_guess(guesses: OnlineGuesses, cache: SlotCache, nxt: LayerCall | None, width: int) -> list[Key]:
    if nxt is None:
        return []
    likely = guesses.predict(nxt.layer, width)
    return [(nxt.layer, e) for e in guesses.choose(nxt.layer, likely, lambda e: cache.holds((nxt.layer, e)))]


def _prefetch(cache: SlotCache, chunk: list[Key], upcoming: Sequence[Key]) -> None:
    """Prefetch as the store's prefetcher does, to completion: never evicting `chunk` nor a guess."""
    if not upcoming:
        return
    cache.protect(chunk)
    for key in cache.plan_prefetch(upcoming):
        if cache.take_prefetch_slot(key) is None:
            break  # no slot left that holds neither a pinned nor a protected key
        cache.finish_read(key, prefetched=True)


def affinity_predictions(
    fit: Sequence[Sequence[LayerCall]], evaluate: Sequence[Sequence[LayerCall]], width: int
) -> list[list[LayerCall]]:
    """``evaluate`` with each call's ``predicted`` set to the ``width`` experts most likely in the next call.

    From ``fit`` it counts, for consecutive layer calls (a, b) of a step, how often expert i of layer a and
    expert j of layer b were used together: P(j | i) = count(i, j) / count(i). A call's prediction for the
    next layer ranks j by the sum of P(j | i) over the experts i the call used. Smoothed (+0.1 per pair) so
    an empty fit window predicts by nothing but id order. The last layer predicts nothing.
    """
    num_experts = 1 + max(
        (max(c.expert_ids, default=0) for part in (fit, evaluate) for step in part for c in step), default=0
    )
    pair_counts: dict[tuple[int, int], np.ndarray] = {}  # (layer, next layer) -> [E, E]
    for step in fit:
        for a, b in zip(step, step[1:]):
            table = pair_counts.setdefault((a.layer, b.layer), np.full((num_experts, num_experts), 0.1))
            table[np.ix_(a.expert_ids, b.expert_ids)] += 1.0
    cond = {pair: t / t.sum(axis=1, keepdims=True) for pair, t in pair_counts.items()}  # P(j | i)
    out = []
    for step in evaluate:
        calls = []
        for index, call in enumerate(step):
            predicted: tuple[Key, ...] = ()
            if index + 1 < len(step):
                nxt = step[index + 1].layer
                given = cond.get((call.layer, nxt))  # [E, E] P(j | i)
                if given is not None:
                    scores = given[list(call.expert_ids)].sum(axis=0)  # [E]
                    best = np.argsort(-scores, kind="stable")[:width]
                    predicted = tuple((nxt, int(e)) for e in best)
            calls.append(LayerCall(call.layer, call.expert_ids, predicted))
        out.append(calls)
    return out


@dataclass
class GridResult:
    """Results of every (policy, capacity, prefetch) combination on one evaluation window."""

    results: list[SimResult]
    fit_steps: int  # steps used only to fit the static profile / affinity table (never evaluated)
    eval_steps: int

    def get(self, policy: str, capacity: int, prefetch: str, cache_mode: str = DEFAULT_CACHE_MODE
            ) -> SimResult | None:
        for r in self.results:
            if (r.policy, r.capacity, r.prefetch, r.cache_mode) == (policy, capacity, prefetch, cache_mode):
                return r
        return None


def run_grid(
    steps: Sequence[Sequence[LayerCall]],
    policies: Sequence[str],
    capacities: Sequence[int],
    prefetches: Sequence[str] = ("none",),
    warmup_fraction: float = 0.5,
    policy_options: dict[str, dict[str, Any]] | None = None,
    affinity_width: int | None = None,
    online: OnlinePrefetch | None = None,
    cache_modes: Sequence[str] = (DEFAULT_CACHE_MODE,),
) -> GridResult:
    """Simulate every combination of policy, capacity, prefetch mode and cache mode.

    When something must be fitted (``static``'s profile, the ``affinity`` table) or learned (the ``online``
    predictor), the first ``warmup_fraction`` of the steps is used only for that and EVERY combination is
    evaluated on the rest, from a cold cache: all numbers in one grid come from the same steps, and none
    from the steps anything was fitted on. The online predictor keeps learning during the evaluation.
    """
    if not 0.0 <= warmup_fraction < 1.0:
        raise ConfigError(f"warm-up fraction {warmup_fraction} must be in [0, 1)")
    for mode in prefetches:
        if mode not in PREFETCH_MODES:
            raise ConfigError(f"prefetch={mode!r}: choose from {', '.join(PREFETCH_MODES)}")
    if "predicted" in prefetches and not any(c.predicted for step in steps for c in step):
        raise ConfigError("prefetch 'predicted': this trace records no predictions (try oracle or affinity)")
    fit: Sequence[Sequence[LayerCall]] = []
    evaluate = steps
    if any(p in _ONLINE for p in prefetches) and online is None:
        raise ConfigError("prefetch 'online' and 'auto' need their settings (OnlinePrefetch)")
    if "static" in policies or "affinity" in prefetches or any(p in _ONLINE for p in prefetches):
        split = int(len(steps) * warmup_fraction)
        fit, evaluate = steps[:split], steps[split:]
    if not evaluate:
        raise ConfigError("the trace has no steps left to evaluate")
    counts = usage_counts(fit)
    reserve = static_reserve(fit or steps)
    width = affinity_width or 2 * reserve
    affinity = affinity_predictions(fit, evaluate, width) if "affinity" in prefetches else []
    if online is not None:  # the online predictor may learn from the fitted part too: it is the past
        online = replace(online, history=fit)
    results = []
    for cache_mode, prefetch, name, capacity in product(cache_modes, prefetches, policies, capacities):
        calls = affinity if prefetch == "affinity" else evaluate
        policy, admission = split_bypass(name)
        if admission and policy not in ONLINE_POLICY_NAMES:
            raise ConfigError(f"{name}: admission control ({BYPASS_SUFFIX}) is for the online policies, "
                              f"{', '.join(ONLINE_POLICY_NAMES)}")
        options = dict((policy_options or {}).get(policy, {}))
        if policy == "static":
            options = {"counts": counts, "num_pinned": max(0, capacity - reserve), **options}
        mode = "predicted" if prefetch == "affinity" else prefetch
        result = simulate(calls, policy, capacity, mode, options, online, cache_mode, admission)
        result.prefetch, result.policy = prefetch, name
        results.append(result)
    return GridResult(results, fit_steps=len(fit), eval_steps=len(evaluate))
