"""AffinityPredictor on hand-made routing sequences with hand-computed answers."""

from __future__ import annotations

import math

import pytest

from moeserve.errors import ConfigError
from moeserve.experts.prefetch.affinity import AffinityPredictor


def test_learns_the_next_layer_and_ignores_step_boundaries():
    p = AffinityPredictor(4)
    assert p.predict(1, 2) == []  # nothing observed yet
    for _ in range(3):  # steps: layer 0 uses {0}, layer 1 uses {3}
        p.observe(0, [0])
        p.observe(1, [3])
    p.observe(0, [0])
    assert p.predict(1, 1) == [3]
    assert p.predict(2, 1) == []  # 0 -> 2 never seen
    p.observe(1, [3])
    assert p.predict(0, 2) == []  # 1 -> 0 is a step boundary, never learned


def test_scores_are_naive_bayes_by_hand():
    # E = 2, s = 0.1. Transitions 0 -> 1: {0} -> {1} twice, {1} -> {0} once.
    p = AffinityPredictor(2, smoothing=0.1)
    for a, b in ((0, 1), (0, 1), (1, 0)):
        p.observe(0, [a])
        p.observe(1, [b])
    table = p._tables[(0, 1)]
    # total 3 (+0.4); col = [1, 2] (+0.2): log P(j) = log(1.2/3.4), log(2.2/3.4)
    # row 0 = 2 (+0.2): P(0|0) = 0.1/2.2, P(1|0) = 2.1/2.2
    expected = [
        math.log(1.2 / 3.4) + math.log(0.1 / 2.2) - math.log(1.2 / 3.4),
        math.log(2.2 / 3.4) + math.log(2.1 / 2.2) - math.log(2.2 / 3.4),
    ]
    assert table.scores([0]) == pytest.approx(expected)
    p.observe(0, [1])  # row 1 = 1 (+0.2): P(0|1) = 1.1/1.2 -> expert 0 first
    assert p.predict(1, 2) == [0, 1]


def test_calibrated_chance_per_rank_and_threshold():
    p = AffinityPredictor(3)
    for _ in range(2):
        p.observe(0, [0])
        p.observe(1, [1])
    # Now guess three times; layer 1 uses the rank-0 guess (1) every time and never the rank-1 guess.
    for _ in range(3):
        p.observe(0, [0])
        assert p.predict(1, 2)[0] == 1
        p.observe(1, [1])
    assert p.chance(0) == pytest.approx((3 + 1) / (3 + 2))
    assert p.chance(1) == pytest.approx((0 + 1) / (3 + 2))
    p.observe(0, [0])
    assert p.predict_with_prob(1, 2, min_prob=0.5) == [(1, pytest.approx(0.8))]


def test_rejects_bad_arguments():
    with pytest.raises(ConfigError):
        AffinityPredictor(0)
    p = AffinityPredictor(2)
    with pytest.raises(ConfigError):
        p.observe(0, [2])


def test_temporal_predicts_the_previous_steps_experts_at_the_predicted_layer():
    """Layer 1 keeps its expert for runs of 8 steps, whatever layer 0 used: only the step-to-step counts see it."""
    import random

    rng = random.Random(0)
    scores = {}
    for temporal in (False, True):
        pred = AffinityPredictor(8, temporal=temporal)
        right = 0
        for t in range(800):
            pred.observe(0, [rng.randrange(8)])
            guess = pred.predict(1, 1)
            used = (t // 8) % 8
            right += t >= 400 and guess == [used]
            pred.observe(1, [used])
        scores[temporal] = right / 400
    assert scores[True] > 0.8 and scores[False] < 0.3
