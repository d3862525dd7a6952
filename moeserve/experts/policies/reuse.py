"""Reuse-distance prediction in the style of Mockingjay (Shah, Jain, Lin, HPCA 2022: "Effective mimicry of Belady's
MIN policy"), for the expert cache: learn, per signature, how many visits of its layer pass before an expert is
used again, and evict the cached expert whose predicted next use is furthest away (`ReusePolicy`, "reuse").
Pure Python; see docs/policies.md ("reuse").
"""

from __future__ import annotations

from collections.abc import Container

from moeserve.errors import ConfigError
from moeserve.experts.policies.base import EvictionPolicy, Key, LazyHeap, no_victim

Signature = tuple[int, int, int]  # (layer, expert, 1 if the use came one visit after the previous one else 0)


class ReusePolicy(EvictionPolicy):
    """Evicts the key predicted to be used furthest in the future, from reuse distances learnt online.

    Time is counted in visits of the key's own layer (as LFRU ages). When a key is used again, the distance since
    its previous use (in its layer's visits) trains the predicted distance of the signature of that previous use:
    the key itself and whether that use followed a use at the visit before (a burst); the estimate moves a
    `rate` of the way to each new observation (temporal-difference learning, Mockingjay's rule). A use sets the
    key's estimated time of arrival ETA = visit + predicted distance. The expected time to the next use, in layer
    calls, is d + n max(0, ETA - now - 1) when the ETA is ahead (d: calls until the layer runs again, n: the cycle
    of MoE layers), and for a key at or past its ETA and unused (the prediction failed: it is probably in a long
    gap) d + n (now - ETA + 1), after Mockingjay's |ETR|. The victim has the longest expected time; per layer only the key with the
    latest ETA and the one most overdue can be it (two heaps per layer: O(layers log n) per victim).

    A prefetched key that was not used yet gets ETA = next visit: if that visit passes without a use it becomes
    overdue and goes early.
    """

    name = "reuse"

    def __init__(self, rate: float = 0.25, burst: bool = True, unseen: float | None = None) -> None:
        """`rate`: the step of the distance estimate towards each observation (0 < rate <= 1). `burst`: the
        signature tells a use right after a use from the others (False: the key alone). `unseen`: the predicted
        distance of a signature never trained (None: the layer's running mean distance)."""
        if not 0 < rate <= 1:
            raise ConfigError(f"reuse: rate={rate} must be in (0, 1]")
        self._rate = rate
        self._burst = burst
        self._unseen = unseen
        self._visits: dict[int, int] = {}  # layer -> visits so far
        self._last_tick: dict[int, int] = {}  # layer -> global tick of its latest visit
        self._tick = 0
        self._distance: dict[Signature, float] = {}  # predicted reuse distance, in visits of the layer
        self._layer_mean: dict[int, float] = {}  # layer -> running mean of observed distances (unseen signatures)
        self._last_use: dict[Key, tuple[int, Signature]] = {}  # key -> (visit of its last use, its signature)
        self._eta: dict[Key, float] = {}  # cached keys -> visit of the predicted next use
        self._late: dict[int, LazyHeap] = {}  # per layer, priority -ETA: the latest ETA on top
        self._early: dict[int, LazyHeap] = {}  # per layer, priority ETA: the most overdue on top

    def begin_layer(self, layer: int) -> None:
        self._tick += 1
        self._visits[layer] = self._visits.get(layer, 0) + 1
        self._last_tick[layer] = self._tick

    def _predicted(self, sig: Signature) -> float:
        found = self._distance.get(sig)
        if found is not None:
            return found
        if self._unseen is not None:
            return self._unseen
        return self._layer_mean.get(sig[0], 1.0)

    def _learn(self, sig: Signature, observed: float) -> None:
        old = self._distance.get(sig)
        self._distance[sig] = observed if old is None else old + self._rate * (observed - old)
        mean = self._layer_mean.get(sig[0])
        self._layer_mean[sig[0]] = observed if mean is None else mean + 0.01 * (observed - mean)

    def _use(self, key: Key) -> None:
        layer = key[0]
        now = self._visits.get(layer, 0)
        previous = self._last_use.get(key)
        burst = 0
        if previous is not None:
            distance = now - previous[0]
            if distance > 0:
                self._learn(previous[1], float(distance))
                burst = 1 if self._burst and distance == 1 else 0
            else:  # used twice in one visit (a chunked call): keep the signature it had
                burst = previous[1][2]
        sig = (layer, key[1], burst)
        self._last_use[key] = (now, sig)
        self._place(key, now + self._predicted(sig))

    def _place(self, key: Key, eta: float) -> None:
        self._eta[key] = eta
        layer = key[0]
        late = self._late.get(layer)
        if late is None:
            late = self._late[layer] = LazyHeap()
            self._early[layer] = LazyHeap()
        late.push(key, -eta)
        self._early[layer].push(key, eta)

    def on_hit(self, key: Key) -> None:
        self._use(key)

    def on_insert(self, key: Key, *, prefetched: bool = False) -> None:
        if prefetched:
            self._place(key, self._visits.get(key[0], 0) + 1.0)
        else:
            self._use(key)

    def on_evict(self, key: Key) -> None:
        if self._eta.pop(key, None) is not None:
            self._late[key[0]].remove(key)
            self._early[key[0]].remove(key)

    def expected_wait(self, layer: int, eta: float) -> float:
        """Expected layer calls until a key of `layer` with this ETA is used (see the class docstring)."""
        n = len(self._visits)
        d = max(1, n - (self._tick - self._last_tick.get(layer, 0)))  # calls until the layer's next visit
        ahead = eta - self._visits.get(layer, 0)  # visits of the layer until the ETA (<= 0: overdue)
        return d + n * (max(0.0, ahead - 1.0) if ahead > 0 else 1.0 - ahead)

    def choose_victim(self, pinned: Container[Key], layers: Container[int] | None = None) -> Key:
        best = -1.0
        victim: Key | None = None
        for layer, late in self._late.items():
            if not len(late) or (layers is not None and layer not in layers):
                continue
            for heap, sign in ((late, -1.0), (self._early[layer], 1.0)):
                found = heap.min_unpinned(pinned)
                if found is None:
                    continue
                wait = self.expected_wait(layer, sign * found[0])
                if wait > best:
                    best, victim = wait, found[1]
        if victim is None:
            raise no_victim(self)
        return victim

    def admit(self, key: Key, victim: Key) -> bool:
        """Cache `key` only if, used now, its expected wait is no longer than `victim`'s."""
        layer = key[0]
        previous = self._last_use.get(key)
        now = self._visits.get(layer, 0)
        burst = 1 if self._burst and previous is not None and now - previous[0] == 1 else 0
        wait = self.expected_wait(layer, now + self._predicted((layer, key[1], burst)))
        return wait <= self.expected_wait(victim[0], self._eta[victim])

    def on_bypass(self, key: Key) -> None:
        self._use(key)
        self.on_evict(key)  # learnt from as a use, not cached
