"""A routing trace as the expert store sees it: layer calls, and the usage profile the `static` policy pins from.

The engine (`cache_policy=static`) and the cache simulator (`moeserve.bench.simulate`) both build on these.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from moeserve.experts.policies import Key
from moeserve.experts.traces.jsonl import read_trace_file
from moeserve.experts.traces.moetrace import Step


@dataclass(frozen=True)
class LayerCall:
    """What one MoE layer asks the store for in one forward step."""

    layer: int
    expert_ids: tuple[int, ...]  # unique, ascending
    predicted: tuple[Key, ...] = ()  # keys recorded as predicted for the next layer call (may be empty)


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


def static_reserve(steps: Iterable[Sequence[LayerCall]]) -> int:
    """Slots the static policy leaves to LRU: the largest expert set one layer call needed."""
    return max((len(call.expert_ids) for step in steps for call in step), default=1)


def static_options(steps: Sequence[Sequence[LayerCall]], capacity: int) -> dict[str, Any]:
    """Options of the `static` policy for a cache of `capacity`: pin the most used experts of `steps`, leaving
    enough slots to LRU for the largest set one layer call needed."""
    return {"counts": usage_counts(steps), "num_pinned": max(0, capacity - static_reserve(steps))}


def static_policy_options(trace_path: str, capacity: int) -> dict[str, Any]:
    """`static_options` from a recorded routing trace file, binary or JSON lines (the engine's `cache_trace`)."""
    _, steps, _ = read_trace_file(trace_path)
    return static_options(calls_from_steps(steps), capacity)
