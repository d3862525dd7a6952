"""prefetch=auto: read predicted experts only while doing so pays on this run's routing (pure Python).

Prefetch pays when the demand misses it saves are worth the reads it makes. Measured online, per window of
`window` reads (or would-be reads), and re-checked at the end of every window:

- while ON: gain = (prefetched units used before eviction - demand misses on units a prefetch evicted, at their
  layer's next call) / prefetched units. The first two are the cache's `prefetch_used` and `prefetch_harm`.
- while OFF (shadow): the guesses that would have been read are still made and scored when their layer runs
  (`ReadCalibration.kept` / `kept_used`); gain = their share used, less the harm per read last measured while on.

ON when gain >= `min_gain` (default 0.5: two prefetch reads must save at least one demand read; what a wrong
read costs is mostly I/O that the compute would have left idle), OFF when gain < `min_gain - hysteresis`. It
starts OFF and measures: on uniform routing no guess is used often enough, so nothing is ever read.
"""

from __future__ import annotations

import logging
from typing import Protocol

from moeserve.errors import ConfigError

log = logging.getLogger("moeserve")


class PrefetchCounts(Protocol):
    """What the cache counts about prefetch (StoreStats), cumulative."""

    @property
    def prefetched(self) -> int: ...

    @property
    def prefetch_used(self) -> int: ...

    @property
    def prefetch_harm(self) -> int: ...


class ShadowCounts(Protocol):
    """Guesses that passed the read gate (read, or not while off) and those then used (ReadCalibration)."""

    kept: int
    kept_used: int


class PrefetchAuto:
    """The on/off decision of prefetch=auto, with its reason (`on`, `reason`); `review` once per guess."""

    def __init__(self, counts: PrefetchCounts, shadow: ShadowCounts, min_gain: float = 0.5, window: int = 512,
                 hysteresis: float = 0.1) -> None:
        if not 0.0 < min_gain <= 1.0 or window < 1 or not 0.0 <= hysteresis < min_gain:
            raise ConfigError(f"prefetch auto: min_gain={min_gain} must be in (0, 1], window={window} >= 1, "
                              f"hysteresis={hysteresis} in [0, min_gain)")
        self._counts = counts
        self._shadow = shadow
        self.min_gain = min_gain
        self.window = window
        self.hysteresis = hysteresis
        self.on = False
        self.reason = f"off: measuring (shadow estimate of the first {window} guesses worth a read)"
        self.switches = 0  # decisions that changed the state
        self.gain: float | None = None  # the latest estimate
        self._harm_per_read = 0.0  # measured while on; charged to the shadow estimate while off
        self._mark = self._snapshot()

    def _snapshot(self) -> tuple[int, int, int, int, int]:
        c, s = self._counts, self._shadow
        return c.prefetched, c.prefetch_used, c.prefetch_harm, s.kept, s.kept_used

    def review(self) -> bool:
        """Re-check once a window of reads (on) or would-be reads (off) is complete; returns `on`."""
        now = self._snapshot()
        d_read, d_used, d_harm, d_kept, d_kept_used = (a - b for a, b in zip(now, self._mark))
        if self.on and d_read >= self.window:
            self._harm_per_read = d_harm / d_read
            gain = (d_used - d_harm) / d_read
            self._decide(self.min_gain - self.hysteresis, gain,
                         f"{gain:.2f} demand misses saved per prefetch read over the last {d_read} reads "
                         f"({d_used} used, {d_harm} evicted and then missed)")
        elif not self.on and d_kept >= self.window:
            gain = d_kept_used / d_kept - self._harm_per_read
            self._decide(self.min_gain, gain,
                         f"shadow estimate {gain:.2f} misses saved per read: of the last {d_kept} guesses worth a "
                         f"read, {d_kept_used} were used (less {self._harm_per_read:.2f} harm per read measured)")
        else:
            return self.on
        self._mark = now
        return self.on

    def _decide(self, threshold: float, gain: float, why: str) -> None:
        on = gain >= threshold
        self.gain = gain
        self.reason = f"{'on' if on else 'off'}: {why}, {'>=' if on else '<'} {threshold:.2f}"
        if on != self.on:
            self.switches += 1
            log.info("prefetch auto: %s", self.reason)
        self.on = on
