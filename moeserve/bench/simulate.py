"""Replay a routing trace through the eviction policies with the expert store's exact semantics.

One global cache of ``capacity`` experts over all MoE layers. Per layer call (`LayerCall`), the store:

1. splits the needed experts (unique, ascending) into chunks of at most ``capacity`` (normally one chunk);
2. per chunk: ``policy.begin_layer``; pins the chunk; counts cached keys as hits (``on_hit``); loads the
   others (misses), evicting ``policy.choose_victim(pinned)`` whenever the cache is full;
3. optionally prefetches the experts expected in the NEXT layer call while this one is pinned (only when the
   call was one chunk); a prefetch is a read, not a hit or a miss, and never evicts a pinned or
   just-prefetched key; then releases the pins.

``hit_rate = hits / (hits + misses)`` over needed (layer, expert) uses, one per layer call (not per token).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from moeserve.errors import ConfigError
from moeserve.experts.affinity import AffinityPredictor
from moeserve.experts.policies import Key, make_policy
from moeserve.experts.trace import Step

# none: demand loading only. oracle: the next layer call's exact experts (an upper bound). predicted: the
# predictions recorded in the trace. affinity: a layer-to-next-layer co-occurrence table fitted on the
# warm-up part of the trace and then frozen (`affinity_predictions`). online: `AffinityPredictor`
# (moeserve/experts/affinity.py) learning as the trace replays (after the warm-up part, if any), with a
# chance threshold and a read budget (`OnlinePrefetch`): what the engine can do.
PREFETCH_MODES = ("none", "oracle", "predicted", "affinity", "online")


@dataclass(frozen=True)
class LayerCall:
    """What one MoE layer asks the store for in one forward step."""

    layer: int
    expert_ids: tuple[int, ...]  # unique, ascending
    predicted: tuple[Key, ...] = ()  # keys recorded as predicted for the next layer call (may be empty)


@dataclass
class SimResult:
    policy: str
    capacity: int
    prefetch: str
    hits: int = 0
    misses: int = 0
    prefetched: int = 0  # prefetch reads
    prefetch_used: int = 0  # prefetched keys that were needed before they were evicted
    steps: int = 0  # forward steps (tokens at batch 1) replayed

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
    """Settings of the ``online`` prefetch mode: an `AffinityPredictor` learning while the trace replays.

    When a layer call starts (the layer has routed: its experts are known) the predictor observes them and
    predicts the next layer call of the same step; once the call's demand loads are done, up to ``width`` predicted experts whose calibrated chance is at least
    ``min_prob`` are prefetched, most likely first, skipping cached ones. With ``budget`` set, prefetch reads
    never exceed ``budget`` x the demand misses so far (a credit of ``budget`` per miss, one spent per
    prefetch read, at most ``width`` saved up). ``history`` is replayed through the predictor only (no cache)
    before the evaluated steps: the past it may learn from.
    """

    num_experts: int
    width: int
    min_prob: float = 0.0
    budget: float | None = None
    history: Sequence[Sequence[LayerCall]] = ()

    def predictor(self) -> AffinityPredictor:
        pred = AffinityPredictor(self.num_experts)
        for step in self.history:
            for call in step:
                pred.observe(call.layer, call.expert_ids)
        return pred


def calls_from_steps(steps: Iterable[Step]) -> list[list[LayerCall]]:
    """Trace steps -> per step, the layer calls the store would see (with recorded predictions, if any)."""
    out: list[list[LayerCall]] = []
    for step in steps:
        calls = []
        for rec in step:
            predicted: tuple[Key, ...] = ()
            if rec.predicted is not None and rec.predicted_layer is not None:
                target = rec.predicted_layer
                predicted = tuple((target, int(e)) for e in sorted(set(rec.predicted.reshape(-1).tolist())))
            calls.append(LayerCall(rec.layer, tuple(rec.unique_experts()), predicted))
        out.append(calls)
    return out


def usage_counts(steps: Iterable[Sequence[LayerCall]]) -> Counter[Key]:
    """How many layer calls needed each (layer, expert): the profile the static policy pins from."""
    counts: Counter[Key] = Counter()
    for step in steps:
        for call in step:
            counts.update((call.layer, e) for e in call.expert_ids)
    return counts


def per_expert_calls(steps: Iterable[Sequence[LayerCall]]) -> list[list[LayerCall]]:
    """Every layer call split into one call per expert (ascending): a cache that sees single-expert
    requests and pins nothing else. This is the access model of the classic per-access simulators (and of
    the FLAME README's sanity figures); the engine's store pins a layer's whole set instead."""
    return [[LayerCall(c.layer, (e,)) for c in step for e in c.expert_ids] for step in steps]


def layer_only(steps: Iterable[Sequence[LayerCall]], layer: int) -> list[list[LayerCall]]:
    """Only ``layer``'s calls: replaying them models a private per-layer cache."""
    return [[c for c in step if c.layer == layer] for step in steps]


def _chunks(call: LayerCall, capacity: int) -> list[list[Key]]:
    ids = call.expert_ids
    return [[(call.layer, e) for e in ids[i : i + capacity]] for i in range(0, len(ids), capacity)]


def simulate(
    steps: Sequence[Sequence[LayerCall]],
    policy: str,
    capacity: int,
    prefetch: str = "none",
    policy_options: dict[str, Any] | None = None,
    online: OnlinePrefetch | None = None,
) -> SimResult:
    """Replay ``steps`` through a fresh, empty cache of ``capacity`` experts managed by ``policy``.

    ``prefetch="online"`` needs ``online`` (the predictor's settings); "affinity" here means: prefetch
    ``call.predicted``, like "predicted".
    """
    if capacity < 1:
        raise ConfigError(f"capacity={capacity}: the cache must hold at least one expert")
    if prefetch not in PREFETCH_MODES:
        raise ConfigError(f"prefetch={prefetch!r}: choose one of {', '.join(PREFETCH_MODES)}")
    if prefetch == "online" and online is None:
        raise ConfigError("prefetch 'online' needs its settings (OnlinePrefetch)")
    calls = [call for step in steps for call in step]
    # Per call: the next call of the same step (online prediction stays within a forward step).
    next_in_step: list[LayerCall | None] = []
    for step in steps:
        next_in_step.extend(list(step[1:]) + [None] if step else [])
    predictor = online.predictor() if online is not None and prefetch == "online" else None
    budget = online.budget if online is not None and predictor is not None else None
    credit = 0.0  # prefetch reads still allowed by the budget
    options = dict(policy_options or {})
    if policy == "belady":
        options["future"] = [chunk for call in calls for chunk in _chunks(call, capacity)]
    pol = make_policy(policy, **options)
    result = SimResult(policy=policy, capacity=capacity, prefetch=prefetch, steps=len(steps))
    cache: set[Key] = set()
    unused_prefetch: set[Key] = set()  # prefetched keys not needed yet

    def make_room(pinned: set[Key]) -> None:
        victim = pol.choose_victim(pinned)
        cache.remove(victim)
        unused_prefetch.discard(victim)
        pol.on_evict(victim)

    for index, call in enumerate(calls):
        chunks = _chunks(call, capacity)
        upcoming: list[Key] = []
        if predictor is not None and online is not None:
            # The layer has routed: its experts are known before any load, so is its guess for the next one.
            predictor.observe(call.layer, call.expert_ids)
            nxt = next_in_step[index]
            if nxt is not None and len(chunks) == 1:
                upcoming = [
                    (nxt.layer, e) for e in predictor.predict(nxt.layer, online.width, online.min_prob)
                ]
        for chunk in chunks:
            pol.begin_layer(call.layer)
            pinned = set(chunk)
            missing = []
            for key in chunk:
                if key in cache:
                    result.hits += 1
                    pol.on_hit(key)
                    if key in unused_prefetch:
                        unused_prefetch.remove(key)
                        result.prefetch_used += 1
                else:
                    missing.append(key)
            for key in missing:
                if len(cache) >= capacity:
                    make_room(pinned)
                cache.add(key)
                pol.on_insert(key)
                result.misses += 1
            if budget is not None and online is not None:
                credit = min(float(online.width), credit + budget * len(missing))
        if prefetch == "none" or len(chunks) > 1:
            continue
        if prefetch == "oracle":
            upcoming = _chunks(calls[index + 1], capacity)[0] if index + 1 < len(calls) else []
        elif prefetch != "online":  # predicted / affinity: the call carries its prediction, most likely first
            upcoming = list(call.predicted)
        for key in upcoming:
            if key in cache:
                continue
            if len(pinned) >= capacity:
                break  # no unpinned slot left to prefetch into
            if budget is not None:
                if credit < 1.0:
                    break  # read budget spent
                credit -= 1.0
            if len(cache) >= capacity:
                make_room(pinned)
            cache.add(key)
            pinned.add(key)
            unused_prefetch.add(key)
            pol.on_insert(key, prefetched=True)
            result.prefetched += 1
    return result


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

    def get(self, policy: str, capacity: int, prefetch: str) -> SimResult | None:
        for r in self.results:
            if (r.policy, r.capacity, r.prefetch) == (policy, capacity, prefetch):
                return r
        return None


def static_reserve(steps: Iterable[Sequence[LayerCall]]) -> int:
    """Slots the static policy leaves to LRU: the largest expert set one layer call needed."""
    return max((len(call.expert_ids) for step in steps for call in step), default=1)


def run_grid(
    steps: Sequence[Sequence[LayerCall]],
    policies: Sequence[str],
    capacities: Sequence[int],
    prefetches: Sequence[str] = ("none",),
    warmup_fraction: float = 0.5,
    policy_options: dict[str, dict[str, Any]] | None = None,
    affinity_width: int | None = None,
    online: OnlinePrefetch | None = None,
) -> GridResult:
    """Simulate every combination of policy, capacity and prefetch mode.

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
    if "online" in prefetches and online is None:
        raise ConfigError("prefetch 'online' needs its settings (OnlinePrefetch)")
    if "static" in policies or "affinity" in prefetches or "online" in prefetches:
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
    for prefetch in prefetches:
        replay = affinity if prefetch == "affinity" else evaluate
        for policy in policies:
            for capacity in capacities:
                options = dict((policy_options or {}).get(policy, {}))
                if policy == "static":
                    options = {"counts": counts, "num_pinned": max(0, capacity - reserve), **options}
                mode = "predicted" if prefetch == "affinity" else prefetch
                result = simulate(replay, policy, capacity, mode, options, online)
                result.prefetch = prefetch
                results.append(result)
    return GridResult(results, fit_steps=len(fit), eval_steps=len(evaluate))
