"""The runtime reserve is sized for the context served (engine/sizing.py `size_for_context`): an automatic
max_model_len keeps exactly what the same context set by hand keeps, on the real configs of
/work/shared/reference/configs (config.json alone, as `moeserve plan` sizes them); and a refusal names the setting
that saves the most, with how much."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from moeserve.config import EngineSettings, build_settings
from moeserve.engine.plan import EnginePlan, PlanningProbe, make_engine_plan
from moeserve.errors import ConfigError
from moeserve.models.config_only import open_for_sizing
from moeserve.models.validate import read_model

CONFIGS = Path("/work/shared/reference/configs")
pytestmark = pytest.mark.skipif(not CONFIGS.is_dir(), reason="the reference configs are not on this machine")


@functools.cache
def _opened(config: str) -> tuple:
    """The config-only checkpoint and its model (built once: DeepSeek-V3's map has 14848 experts)."""
    ckpt = open_for_sizing(str(CONFIGS / config))
    return (ckpt, *read_model(ckpt))


def plan(config: str, **settings: object) -> EnginePlan:
    s: EngineSettings = build_settings(EngineSettings, {"model": str(CONFIGS / config), "device": "cpu",
                                                        "dtype": "bfloat16", **settings})
    ckpt, arch, spec = _opened(config)
    return make_engine_plan(ckpt, arch, spec, s, PlanningProbe())


# (config, memory_gb, experts kept before this change: the runtime sized for the model's whole context)
CASES = [("DeepSeek-V3.json", 64, 167), ("GLM-4.5-Air.json", 24, 150), ("Qwen3.5-35B-A3B.json", 24, 1971)]


@pytest.mark.parametrize(("config", "memory_gb", "before"), CASES)
def test_automatic_context_keeps_what_the_same_context_set_by_hand_keeps(config: str, memory_gb: int,
                                                                          before: int) -> None:
    auto = plan(config, memory_gb=memory_gb)
    ctx = auto.max_model_len
    by_hand = plan(config, memory_gb=memory_gb, max_model_len=ctx)
    assert auto.expert_capacity == by_hand.expert_capacity > before
    assert auto.kv_bytes == by_hand.kv_bytes and auto.sizes.split.overhead_bytes == by_hand.sizes.split.overhead_bytes
    assert ctx < auto.needs.model_max_len
    line = dict(auto.choices)["max_model_len"]
    assert line.startswith(f"{ctx} (auto: the model's {auto.needs.model_max_len} does not fit memory_gb=")
    # the longest such context: 64 tokens more and its own runtime leaves no pool that holds it
    with pytest.raises(ConfigError):
        plan(config, memory_gb=memory_gb, max_model_len=ctx + 64, kv_cache_gb=auto.kv_bytes / 2**30)


def test_deepseek_v3_at_48_gb_fits_with_a_shorter_context() -> None:
    """Refused before (the runtime sized for 163840 tokens alone took 22.6 GiB); now served at a shorter context."""
    auto = plan("DeepSeek-V3.json", memory_gb=48)
    assert 8192 <= auto.max_model_len < 163840 and auto.expert_capacity > 0


def test_a_refusal_names_the_setting_that_saves_the_most() -> None:
    with pytest.raises(ConfigError) as err:
        plan("DeepSeek-V3.json", memory_gb=48, max_model_len=163840)
    text = str(err.value)
    assert "exceed memory_gb=48" in text
    head, advice = text.split("; what saves the most: ")
    first, second = advice.split(", then ")
    assert first.startswith("max_model_len=") and " fits (" in first and "GiB less)" in first
    assert second.startswith("max_num_batched_tokens=9 (")
