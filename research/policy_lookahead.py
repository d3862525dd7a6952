"""How much could knowing the next layer calls help an eviction policy? Cycle-aware LFRU told the exact experts of
the next `L` layer calls (an oracle no online policy has): keys needed within them are never evicted, and keys of
those calls' layers that they do not need wait one more cycle. If even this barely beats LFRU, no predictor of the
next calls (the token's own previous-layer choices, co-occurrence) can do much better by eviction alone.

    .venv/bin/python research/policy_lookahead.py /work/shared/traces/flame-moe-290m --capacity 64,128,256 \
        --lookahead 0,1,2,7

Evaluated like research/policy_table.py: the second half of the steps, from a cold cache, demand loading. Slow
(the victim is found by a scan of the cache): a measurement, not a policy.
"""

from __future__ import annotations

import argparse
from collections.abc import Container, Sequence

from moeserve.bench.simulate import simulate
from moeserve.cli.simulate import load_calls
from moeserve.experts import policies
from moeserve.experts.policies import Key, LFRUPolicy, NoVictimError


class LookaheadLFRU(LFRUPolicy):
    """Cycle-aware LFRU (without the adaptive recency fallback) that knows the keys of the next `lookahead` calls."""

    name = "lookahead-lfru"

    def __init__(self, future: Sequence[Sequence[Key]], lookahead: int = 1) -> None:
        super().__init__(cycle_aware=True)
        self._future = [set(keys) for keys in future]
        self._now = -1
        self._cached: set[Key] = set()
        self._lookahead = lookahead

    def begin_layer(self, layer: int) -> None:
        super().begin_layer(layer)
        self._now += 1

    def on_insert(self, key: Key, *, prefetched: bool = False) -> None:
        super().on_insert(key, prefetched=prefetched)
        self._cached.add(key)

    def on_evict(self, key: Key) -> None:
        super().on_evict(key)
        self._cached.discard(key)

    def choose_victim(self, pinned: Container[Key], layers: Container[int] | None = None) -> Key:
        upcoming = self._future[self._now + 1 : self._now + 1 + self._lookahead]
        soon = set().union(*upcoming)
        soon_layers = {key[0] for keys in upcoming for key in keys}
        cycle = len(self._visits)
        best, victim = -1.0, None
        for key in self._cached:
            if key in pinned or (layers is not None and key[0] not in layers):
                continue
            wait = 0.0 if key in soon else self._time_to_use(key[0], self._log_score_now(key))
            if key not in soon and key[0] in soon_layers:
                wait += cycle  # known unused at its layer's next call
            if wait > best:
                best, victim = wait, key
        if victim is None:
            raise NoVictimError("every cached key is pinned")
        return victim


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--capacity", default="64,128,256")
    ap.add_argument("--lookahead", default="0,1,2,7")
    args = ap.parse_args()
    _, steps, _ = load_calls(args.trace)
    evaluate = steps[len(steps) // 2 :]
    future = [[(c.layer, e) for e in c.expert_ids] for step in evaluate for c in step]
    policies._REGISTRY[LookaheadLFRU.name] = LookaheadLFRU  # this script's measurement only
    caps = [int(c) for c in args.capacity.split(",")]
    print("lookahead  " + "".join(f"{c:>15}" for c in caps) + "   (hit rate (experts read per step))")
    for lookahead in (int(x) for x in args.lookahead.split(",")):
        cells = []
        for capacity in caps:
            r = simulate(evaluate, LookaheadLFRU.name, capacity,
                         policy_options={"future": future, "lookahead": lookahead})
            cells.append(f"{r.hit_rate:.3f} ({r.reads_per_step:4.1f})")
        print(f"{lookahead:<11}" + "".join(f"{x:>15}" for x in cells), flush=True)


if __name__ == "__main__":
    main()
