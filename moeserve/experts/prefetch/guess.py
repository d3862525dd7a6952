"""What the store's own prefetch reads: the same decision in the engine and in `moeserve simulate` (pure Python).

At each layer call (its experts known) `OnlineGuesses.observe` teaches the `AffinityPredictor`
(experts/prefetch/affinity.py) and `predict` names the next MoE layer's experts with at least `min_prob` calibrated chance,
most likely first. Once the call's experts are in, `choose` keeps those already cached (to protect them until that
layer runs) and the uncached ones only while such guesses have been used often enough to pay for their read
(`ReadCalibration`): the predictor's calibration covers every guess, and the likely ones are mostly cached
already, so the uncached rest can be far less likely. While that gate is shut, the guessing itself (Python at
every layer, with the CPU caches cold after the layer's compute) runs on one call in PROBE_EVERY, enough to notice
when uncached guesses become worth reading again; so does it while prefetch=auto (`PrefetchAuto`) has decided that
reads do not pay (before its first decision it guesses on every call, to decide soon).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Protocol

from moeserve.experts.prefetch.affinity import AffinityPredictor
from moeserve.experts.prefetch.auto import PrefetchAuto, PrefetchCounts

PROBE_EVERY = 8  # with the read gate shut, the predictor guesses on one layer call in this many
PROBE_AFTER = 64  # ... once this many first uncached guesses were scored (before that it always guesses)


class Predictor(Protocol):
    """What `OnlineGuesses` asks of a predictor (AffinityPredictor; tests pass stand-ins)."""

    def observe(self, layer: int, expert_ids: Sequence[int]) -> None: ...

    def predict(self, layer: int, k: int, min_prob: float = 0.0) -> list[int]: ...


class ReadCalibration:
    """How often a guess that is NOT cached gets used, per position among a guess's uncached experts: the chance
    that prefetching it pays its read. Every guess is scored when its layer runs, read or not, so the estimate
    keeps learning while prefetch reads nothing."""

    def __init__(self, num_experts: int) -> None:
        self._guesses = [0] * num_experts  # per position: uncached guesses scored
        self._used = [0] * num_experts  # per position: those the layer then used
        self._pending: dict[int, tuple[list[int], int]] = {}  # layer -> its uncached guesses, how many kept
        # The guesses `keep` passed (read, or would have been read with prefetch off), and those then used: the
        # shadow estimate of prefetch=auto (`PrefetchAuto`).
        self.kept = 0
        self.kept_used = 0

    def chance(self, position: int) -> float:
        return (self._used[position] + 1) / (self._guesses[position] + 2)

    def scored(self, position: int) -> int:
        """Uncached guesses at `position` scored so far."""
        return self._guesses[position]

    def keep(self, layer: int, uncached: list[int], min_prob: float) -> list[int]:
        """The leading uncached guesses (most likely first) whose position has been used >= `min_prob` of the
        time; remembers all of them to score when `layer` runs."""
        n = 0
        while n < len(uncached) and self.chance(n) >= min_prob:
            n += 1
        self._pending[layer] = (uncached, n)
        return uncached[:n]

    def check(self, layer: int, used: Collection[int]) -> None:
        """`layer` ran with experts `used`: score its pending uncached guesses."""
        pending = self._pending.pop(layer, None)
        if pending:
            guessed, kept = pending
            needed = set(used)
            for position, e in enumerate(guessed):
                hit = e in needed
                self._guesses[position] += 1
                self._used[position] += hit
                if position < kept:
                    self.kept += 1
                    self.kept_used += hit


class OnlineGuesses:
    """The store's prefetch guesses, learned from its own layer calls."""

    def __init__(self, num_experts: int, min_prob: float, predictor: Predictor | None = None,
                 auto: PrefetchCounts | None = None) -> None:
        """`auto`: the cache's prefetch counters; reads then happen only while `PrefetchAuto` says they pay."""
        self.predictor: Predictor = predictor if predictor is not None else AffinityPredictor(num_experts)
        self.min_prob = min_prob
        self.reads_worth = ReadCalibration(num_experts)
        self.auto = PrefetchAuto(auto, self.reads_worth) if auto is not None else None
        self._calls = 0  # guesses asked for (see PROBE_EVERY)

    def observe(self, layer: int, expert_ids: Sequence[int]) -> None:
        """`layer` has routed to `expert_ids` (every layer call, before its experts are acquired)."""
        self.predictor.observe(layer, expert_ids)
        self.reads_worth.check(layer, expert_ids)

    def predict(self, next_layer: int, width: int) -> list[int]:
        """Up to `width` experts of `next_layer` with at least `min_prob` chance, most likely first; [] on a call
        that does not probe while the read gate is shut. Then `choose` against the cache."""
        self._calls += 1
        rw = self.reads_worth
        shut = rw.chance(0) < self.min_prob or (self.auto is not None and not self.auto.on and self.auto.gain is not None)
        if shut and rw.scored(0) >= PROBE_AFTER and self._calls % PROBE_EVERY:
            return []
        return self.predictor.predict(next_layer, width, self.min_prob)

    def choose(self, next_layer: int, likely: list[int], held: Callable[[int], bool]) -> list[int]:
        """Of `likely` (from `predict`), in order: those already `held` (ready or loading: to protect) and the
        uncached ones that pass the read gate (to read)."""
        if not likely:
            return []
        cached = [held(e) for e in likely]
        read = set(self.reads_worth.keep(next_layer, [e for e, c in zip(likely, cached) if not c], self.min_prob))
        if self.auto is not None and not self.auto.review():
            read = set()  # prefetch=auto, off: the guesses are scored (the shadow estimate), nothing is read
        return [e for e, c in zip(likely, cached) if c or e in read]
