"""Cross-layer expert affinity, learned online: which experts layer L+1 will need, given what layer L used.

Pure Python (no torch, no numpy). Nothing here looks at the future: the predictor only learns from the layer
calls it has been told about, in order.

Interface (what the expert store / the simulator call)::

    pred = AffinityPredictor(num_experts)
    # every MoE layer call of a forward step, layers in ascending order, AFTER the layer has routed:
    pred.observe(layer, expert_ids)            # the unique experts the layer used (batch: their union)
    ids = pred.predict(next_layer, k)          # <= k experts of next_layer, most likely first
    ids = pred.predict(next_layer, k, min_prob=0.5)   # only those whose estimated chance is >= 0.5
    pairs = pred.predict_with_prob(next_layer, k)     # [(expert, estimated chance of being needed)]

`predict` answers from the latest `observe` call (the layer just routed) and only for the layer observed
right after it in earlier forward steps; otherwise it returns ``[]``. Call order per layer call: ``observe``
then ``predict`` for the next layer. The forward step boundary needs no call: a layer lower than the
previous one starts a new step.

Model. For every pair of consecutive MoE layers (a, b) it counts how often expert i of a and expert j of b
were used in the same forward step, ``c[i][j]``, with ``s`` (default 0.1) added to every pair. Experts of b
are ranked by a naive-Bayes score given the set S of experts a used::

    score(j) = log P(j) + sum over i in S of log( P(j | i) / P(j) )

``P(j | i) = c[i][j] / sum_j c[i][j]`` and ``P(j)`` the share of b's counts that j holds. The chance
attached to a prediction is calibrated, not the score: per rank r (0 = most likely) the predictor keeps how
often its rank-r guess for a layer was then actually used by that layer, and reports
``(hits_r + 1) / (guesses_r + 2)``. ``min_prob=0.5`` therefore keeps only guesses that, on past evidence,
are used at least half of the time: such a prefetch does not raise the expected number of reads.

Cost per call: ``observe`` O(|S_a| x |S_b|) counter updates; ``predict`` O(|S| x num_experts) float ops
(384 for top-6 of 64) plus a sort of num_experts numbers.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable

from moeserve.errors import ConfigError


class _Transition:
    """Co-occurrence counts from one layer's experts (a) to a later layer's experts (b), with their logs."""

    def __init__(self, num_experts: int, smoothing: float) -> None:
        e, s = num_experts, smoothing
        self.pair = [[0.0] * e for _ in range(e)]  # pair[i][j]: times i (layer a) and j (layer b) co-occurred
        self.row = [0.0] * e  # row[i] = sum_j pair[i][j]
        self.col = [0.0] * e  # col[j] = sum_i pair[i][j]
        self.total = 0.0
        self.s = s
        self.e = e
        self.log_pair = [[math.log(s)] * e for _ in range(e)]  # log(pair[i][j] + s)
        self.log_row = [math.log(s * e)] * e  # log(row[i] + s e): log P(j | i) = log_pair[i][j] - log_row[i]
        self.log_col = [math.log(s * e)] * e  # log(col[j] + s e): log P(j) up to a constant

    def add(self, a_ids: list[int], b_ids: list[int]) -> None:
        nb, na, s, e = len(b_ids), len(a_ids), self.s, self.e
        for i in a_ids:
            row, log_pair = self.pair[i], self.log_pair[i]
            for j in b_ids:
                row[j] += 1.0
                log_pair[j] = math.log(row[j] + s)
            self.row[i] += nb
            self.log_row[i] = math.log(self.row[i] + s * e)
        for j in b_ids:
            self.col[j] += na
            self.log_col[j] = math.log(self.col[j] + s * e)
        self.total += na * nb

    def log_prior(self) -> list[float]:
        """log P(j) for every expert j of layer b."""
        log_total = math.log(self.total + self.s * self.e * self.e)
        return [c - log_total for c in self.log_col]

    def scores(self, a_ids: list[int]) -> list[float]:
        """Naive-Bayes log score of every expert of layer b given layer a used ``a_ids`` (this table alone)."""
        shift = sum(self.log_row[i] for i in a_ids)  # the same for every j: only the ranking needs none
        return [x - shift for x in _naive_bayes(self.log_prior(), [self.log_pair[i] for i in a_ids])]


def _naive_bayes(log_prior: list[float], log_pairs: list[list[float]]) -> list[float]:
    """log P(j) + sum over the rows of (log pair[i][j] - log P(j)), for every j: the naive-Bayes log score
    up to terms that do not depend on j (the rows' log totals)."""
    w = 1 - len(log_pairs)
    return (
        [w * p + sum(column) for p, column in zip(log_prior, zip(*log_pairs), strict=True)]
        if log_pairs
        else list(log_prior)
    )


class AffinityPredictor:
    """Predicts the next MoE layer's experts from the experts this step's latest layers used (module doc)."""

    def __init__(self, num_experts: int, depth: int = 2, smoothing: float = 0.1, temporal: bool = True) -> None:
        """`temporal`: also learn from the previous step's experts at the predicted layer (consecutive tokens
        share experts in decode; see docs/policies.md for what it gains)."""
        if num_experts < 1:
            raise ConfigError(f"affinity: num_experts={num_experts} must be >= 1")
        if depth < 1:
            raise ConfigError(f"affinity: depth={depth} must be >= 1 (layers looked back)")
        if smoothing <= 0:
            raise ConfigError(f"affinity: smoothing={smoothing} must be > 0")
        self.num_experts = num_experts
        self.depth = depth
        self._smoothing = smoothing
        self._tables: dict[tuple[int, int], _Transition] = {}  # (layer a, later layer b) -> counts
        self._recent: list[tuple[int, list[int]]] = []  # this step's latest `depth` (layer, expert ids)
        self._temporal: dict[int, _Transition] | None = {} if temporal else None  # layer -> its step-to-step counts
        self._previous: dict[int, list[int]] = {}  # layer -> its experts in the latest step it ran
        self._pending: dict[int, list[int]] = {}  # layer -> ranking guessed for it, not yet checked
        self._guesses: list[int] = [0] * num_experts  # per rank: guesses checked
        self._hits: list[int] = [0] * num_experts  # per rank: guesses that the layer then used

    def observe(self, layer: int, expert_ids: Iterable[int]) -> None:
        """``layer`` just used ``expert_ids`` (in this forward step, after the lower layers)."""
        ids = sorted({int(e) for e in expert_ids})
        for e in ids:
            if not 0 <= e < self.num_experts:
                raise ConfigError(f"affinity: expert {e} outside 0..{self.num_experts - 1}")
        ranking = self._pending.pop(layer, None)
        if ranking is not None:  # score the guess made for this layer: the calibration per rank
            used = set(ids)
            for rank, e in enumerate(ranking):
                self._guesses[rank] += 1
                self._hits[rank] += e in used
        if self._recent and self._recent[-1][0] >= layer:
            self._recent = []  # a new forward step
        for src, src_ids in self._recent:  # learn every recent layer of this step -> this layer
            table = self._tables.get((src, layer))
            if table is None:
                table = self._tables[(src, layer)] = _Transition(self.num_experts, self._smoothing)
            table.add(src_ids, ids)
        self._recent = (self._recent + [(layer, ids)])[-self.depth :]
        if self._temporal is not None:
            before = self._previous.get(layer)
            if before is not None:
                table = self._temporal.get(layer)
                if table is None:
                    table = self._temporal[layer] = _Transition(self.num_experts, self._smoothing)
                table.add(before, ids)
            self._previous[layer] = ids

    def chance(self, rank: int) -> float:
        """Calibrated chance that a rank-``rank`` guess is used: (hits + 1) / (guesses + 2) so far."""
        return (self._hits[rank] + 1) / (self._guesses[rank] + 2)

    def predict_with_prob(self, next_layer: int, k: int, min_prob: float = 0.0) -> list[tuple[int, float]]:
        """Up to ``k`` experts of ``next_layer``, most likely first, with their calibrated chance; only those
        with chance >= ``min_prob``. Empty when the latest observed layer was never followed by
        ``next_layer``."""
        if not self._recent or k <= 0:
            return []
        latest = self._tables.get((self._recent[-1][0], next_layer))
        if latest is None:
            return []
        rows: list[list[float]] = []
        for src, src_ids in self._recent:
            table = self._tables.get((src, next_layer))
            if table is not None:
                rows.extend(table.log_pair[i] for i in src_ids)
        temporal = self._temporal.get(next_layer) if self._temporal is not None else None
        if temporal is not None:  # the previous step's experts at the predicted layer
            rows.extend(temporal.log_pair[i] for i in self._previous[next_layer])
        scores = _naive_bayes(latest.log_prior(), rows)
        k = min(k, self.num_experts)
        ranking = heapq.nsmallest(k, range(self.num_experts), key=lambda j: (-scores[j], j))
        self._pending[next_layer] = ranking
        out = []
        for rank, e in enumerate(ranking[:k]):
            p = self.chance(rank)
            if p < min_prob:
                break  # the calibrated chance falls with the rank (mostly): stop at the first below
            out.append((e, p))
        return out

    def predict(self, next_layer: int, k: int, min_prob: float = 0.0) -> list[int]:
        """Up to ``k`` expert ids of ``next_layer``, most likely first (see `predict_with_prob`)."""
        return [e for e, _ in self.predict_with_prob(next_layer, k, min_prob)]
