"""Routing traces the policy tests replay through `SlotCache`: FLAME-MoE-290M (the sample traces beside the
checkout; 8 MoE layers x 64 experts, top-6, 16,384 layer calls) and two decode traces of the bundled demo model
(4 layers x 8 experts, top-2) recorded with

    moeserve trace record --out DIR --tokens 64 --prompts 4 --batch 4   # batch1.jsonl
    moeserve trace record --out DIR --tokens 64 --prompts 8 --batch 4   # batch4.jsonl

kept in tests/experts/data (docs/trace-format.md), so no test records them again."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pytest

from moeserve.cli.simulate import load_calls
from moeserve.experts.calls import LayerCall
from moeserve.experts.policies.base import Key
from moeserve.experts.slot_cache import SlotCache

_CANDIDATES = [Path(__file__).resolve().parents[3] / "shared", Path("/work/shared")]
FLAME = next((p for p in _CANDIDATES if p.is_dir()), _CANDIDATES[0]) / "traces" / "flame-moe-290m"
DATA = Path(__file__).resolve().parent / "data"
# trace -> three capacities (slots): scarce, middling, roomy; every one divisible among the trace's layers.
TRACES = {"flame": (64, 128, 256), "demo-batch1": (8, 12, 20), "demo-batch4": (8, 12, 20)}


@functools.cache
def trace_calls(name: str) -> tuple[LayerCall, ...]:
    """Every layer call of the trace `name` (a key of TRACES), in order; skips the test without FLAME."""
    if name == "flame":
        if not FLAME.is_dir():
            pytest.skip("FLAME sample traces not present beside the checkout")
        path = FLAME
    else:
        path = DATA / f"{name}.jsonl"
    _, steps, _ = load_calls(path)
    return tuple(call for step in steps for call in step)


Event = tuple[str, Key, "Key | None"]  # ("hit" | "miss" | "bypass", key, the key a miss evicted or None)


def replay_store_calls(make_cache: Callable[[Callable[[Key, int], None]], SlotCache], calls: tuple[LayerCall, ...],
                       admission: bool) -> tuple[SlotCache, list[Event]]:
    """The cache calls `ExpertStore._acquire` makes for each chunk, reads landing at once (as the simulator does):
    pin, begin_call, per miss `admits` (with `admission`) then `bypass` or `take_miss_slot` + `finish_read`,
    release. `make_cache(on_map)`: the cache, built with that map listener. Returns it and every hit, miss (with
    its victim) and bypass in order."""
    events: list[Event] = []
    evicted: list[Key] = []
    cache = make_cache(lambda key, slot: evicted.append(key) if slot < 0 else None)
    for call in calls:
        limit, ids = cache.chunk_limit(call.layer), call.expert_ids
        for i in range(0, len(ids), limit):
            chunk = [(call.layer, e) for e in ids[i : i + limit]]
            cache.pin(chunk)
            misses = cache.begin_call(call.layer, chunk)
            events.extend(("hit", k, None) for k in chunk if k not in misses)
            for key in misses:
                if admission and not cache.admits(key):
                    cache.bypass(key)
                    events.append(("bypass", key, None))
                    continue
                evicted.clear()
                assert cache.take_miss_slot(key) is not None
                cache.finish_read(key)
                events.append(("miss", key, evicted[0] if evicted else None))
            cache.release(chunk)
    return cache, events
