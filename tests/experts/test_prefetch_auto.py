"""prefetch=auto (experts/prefetch/auto.py): the on/off decision from measured gains, its shadow estimate while off,
the harm counter it uses (SlotCache.prefetch_harm), the simulator's `auto` mode, the setting, and /metrics."""

from __future__ import annotations

import argparse
import logging
import random
from types import SimpleNamespace

import pytest

from moeserve.bench.simulate import LayerCall, OnlinePrefetch, simulate
from moeserve.config import EngineSettings, add_cli_arguments, build_settings, settings_from_args
from moeserve.errors import ConfigError
from moeserve.experts.policies import make_policy
from moeserve.experts.prefetch.auto import PrefetchAuto
from moeserve.experts.prefetch.guess import OnlineGuesses
from moeserve.experts.slot_cache import SlotCache


def counters(**values: int) -> SimpleNamespace:
    return SimpleNamespace(**{"prefetched": 0, "prefetch_used": 0, "prefetch_harm": 0, "kept": 0, "kept_used": 0,
                              **values})


def test_starts_off_and_turns_on_when_the_shadow_guesses_pay(caplog):
    c = counters()
    auto = PrefetchAuto(c, c, window=100)
    assert not auto.on and auto.reason.startswith("off: measuring")
    c.kept, c.kept_used = 99, 90
    assert not auto.review()  # the window is not complete
    c.kept = 100
    with caplog.at_level(logging.INFO, logger="moeserve"):
        assert auto.review()
    assert auto.reason.startswith("on: shadow estimate 0.90") and "prefetch auto: on" in caplog.text


def test_measured_gain_counts_the_misses_prefetch_caused_and_switches_off_with_hysteresis():
    c = counters()
    auto = PrefetchAuto(c, c, window=100, min_gain=0.5, hysteresis=0.1)
    c.kept, c.kept_used = 100, 80
    assert auto.review()
    c.prefetched, c.prefetch_used, c.prefetch_harm = 100, 50, 5  # gain 0.45: within the hysteresis, stays on
    assert auto.review() and auto.gain == pytest.approx(0.45)
    c.prefetched, c.prefetch_used, c.prefetch_harm = 200, 90, 15  # this window: (40 - 10) / 100 = 0.30
    assert not auto.review() and auto.reason.startswith("off: 0.30 demand misses saved")
    # off again: the harm per read measured while on (0.10) is charged to the shadow estimate
    c.kept, c.kept_used = 200, 137  # 0.57 - 0.10 = 0.47 < 0.5
    assert not auto.review() and auto.gain == pytest.approx(0.47)
    assert auto.switches == 2


def test_bad_settings_are_refused():
    c = counters()
    with pytest.raises(ConfigError, match="min_gain"):
        PrefetchAuto(c, c, min_gain=0.0)


class Fixed:
    """A predictor that always guesses `ids`."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def observe(self, layer, expert_ids) -> None:  # noqa: ANN001
        pass

    def predict(self, layer, k, min_prob=0.0):  # noqa: ANN001
        return self.ids[:k]


def test_with_reads_off_the_guesses_are_still_scored_and_only_cached_ones_kept():
    c = counters()
    guesses = OnlineGuesses(8, 0.0, Fixed([1, 2]), auto=c)
    assert guesses.auto is not None and not guesses.auto.on
    chosen = guesses.choose(3, guesses.predict(3, 2), lambda e: e == 2)
    assert chosen == [2]  # 2 is cached (protected); 1 would be read: not while off
    guesses.observe(3, [1, 5])
    assert (guesses.reads_worth.kept, guesses.reads_worth.kept_used) == (1, 1)


def test_a_key_evicted_by_a_prefetch_and_missed_at_its_layers_next_call_is_harm():
    cache = SlotCache(2, make_policy("lru"), (0, 1))
    for key in [(0, 0), (1, 0)]:
        cache.pin([key])
        for miss in cache.begin_call(key[0], [key]):
            cache.take_miss_slot(miss)
            cache.finish_read(miss)
        cache.release([key])
    cache.protect([(1, 0)])
    assert cache.take_prefetch_slot((1, 1)) is not None  # evicts (0, 0), the LRU
    cache.finish_read((1, 1), prefetched=True)
    assert cache.begin_call(0, [(0, 0)]) == [(0, 0)]
    assert cache.stats.prefetch_harm == 1


def cyclic_steps(n: int, rng: random.Random | None) -> list[list[LayerCall]]:
    """Layer 1 uses the expert layer 0 used (perfectly predictable), or, with `rng`, independent random experts."""
    steps = []
    for t in range(n):
        e = (t * 5) % 16
        other = rng.randrange(16) if rng else e
        steps.append([LayerCall(0, (e,)), LayerCall(1, (other,))])
    return steps


def test_simulated_auto_reads_when_guesses_pay_and_not_on_random_routing():
    online = OnlinePrefetch(16, None, 0.0)
    good = cyclic_steps(4000, None)
    on = simulate(good, "lru", 4, "online", online=online)
    auto = simulate(good, "lru", 4, "auto", online=online)
    assert auto.auto is not None and auto.auto.startswith("on:")
    assert auto.prefetched > 0.5 * on.prefetched and auto.hit_rate > 0.8 * on.hit_rate
    noise = cyclic_steps(4000, random.Random(0))
    off = simulate(noise, "lru", 4, "auto", online=online)
    assert off.auto is not None and off.auto.startswith("off:")
    assert off.prefetched < 0.05 * simulate(noise, "lru", 4, "online", online=online).prefetched


def test_the_setting_takes_true_false_and_auto():
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser, EngineSettings)
    assert settings_from_args(EngineSettings, parser.parse_args(["--prefetch"])).prefetch is True
    assert settings_from_args(EngineSettings, parser.parse_args(["--no-prefetch"])).prefetch is False
    assert settings_from_args(EngineSettings, parser.parse_args(["--prefetch", "auto"])).prefetch == "auto"
    assert build_settings(EngineSettings, {}, environ={"MOESERVE_PREFETCH": "auto"}).prefetch == "auto"
    with pytest.raises(ConfigError, match="prefetch"):
        build_settings(EngineSettings, {"prefetch": "sometimes"}, environ={})


def test_metrics_export_the_decision_and_its_reason():
    from moeserve.experts.slot_cache import StoreStats
    from moeserve.server.metrics import ServerMetrics

    store = SimpleNamespace(stats=StoreStats(), device=SimpleNamespace(type="cpu"), cache_nbytes=1, host_nbytes=0,
                            prefetch_decision=lambda: (False, "off: measuring"))
    engine = SimpleNamespace(expert_store=lambda: store, startup_choices=lambda: {},
                             sequence_memory_stats=lambda: {})
    text = ServerMetrics("m").render(engine)
    assert 'expert_prefetch_enabled{model_name="m",reason="off: measuring"} 0' in text


def test_the_engine_with_auto_prefetch_and_per_layer_quotas_gives_the_resident_tokens(caplog):
    """The trained demo model (real locality), offloaded to 3 experts per layer: same tokens as resident; the mode and
    the prefetch decision are in the start-up line and the store."""
    from pathlib import Path

    import moeserve
    from moeserve import LLM, SamplingParams

    demo = Path(moeserve.__file__).resolve().parent / "demo_model"
    if not (demo / "model.safetensors").is_file():
        pytest.skip("demo model not built")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["Once upon a time", "It is a truth universally acknowledged, that"]
    resident = LLM(str(demo), dtype="float32", threads=1)
    unit = resident.engine.model.store.unit_nbytes
    want = [o.outputs[0].token_ids for o in resident.generate(prompts, params)]
    with caplog.at_level(logging.DEBUG, logger="moeserve"):
        llm = LLM(str(demo), dtype="float32", threads=1, expert_cache_gb=12 * unit / 2**30, prefetch="auto",
                  expert_cache_mode="per_layer")
    assert "cache mode per_layer: 3 slots per MoE layer" in caplog.text and "prefetch auto" in caplog.text
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want and llm.stats.misses > 0
    decision = llm.engine.model.store.prefetch_decision()
    assert decision is not None and decision[1]
    llm.engine.close()
