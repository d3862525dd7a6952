"""The one settings model: keywords, MOESERVE_* env vars and CLI flags; unknown names are errors."""

from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError

from moeserve.config import (
    EngineSettings,
    ServerSettings,
    add_cli_arguments,
    build_settings,
    check_environment,
    settings_from_args,
)
from moeserve.errors import ConfigError


def test_unknown_keyword_did_you_mean() -> None:
    with pytest.raises(ConfigError, match="unknown setting 'expert_cache_gib'.*did you mean 'expert_cache_gb'"):
        build_settings(EngineSettings, {"expert_cache_gib": 2}, environ={})


def test_unknown_env_var_did_you_mean() -> None:
    with pytest.raises(ConfigError, match="MOESERVE_EXPERT_CACH_GB.*did you mean 'MOESERVE_EXPERT_CACHE_GB'"):
        check_environment({"MOESERVE_EXPERT_CACH_GB": "2"})


def test_env_is_read_and_keyword_wins() -> None:
    env = {"MOESERVE_DTYPE": "bfloat16", "MOESERVE_MAX_NUM_SEQS": "3", "MOESERVE_PREFETCH": "true"}
    s = build_settings(EngineSettings, {}, environ=env)
    assert (s.dtype, s.max_num_seqs, s.prefetch) == ("bfloat16", 3, True)
    s = build_settings(EngineSettings, {"dtype": "float32"}, environ=env)
    assert s.dtype == "float32"


def test_invalid_value_is_one_line() -> None:
    with pytest.raises(ConfigError, match="invalid setting dtype"):
        build_settings(EngineSettings, {"dtype": "float8"}, environ={})
    with pytest.raises(ConfigError, match="invalid setting max_num_seqs"):
        build_settings(EngineSettings, {}, environ={"MOESERVE_MAX_NUM_SEQS": "zero"})


def test_settings_are_frozen() -> None:
    s = build_settings(EngineSettings, {}, environ={})
    with pytest.raises(ValidationError, match="frozen"):
        s.dtype = "float32"  # type: ignore[misc]


def test_cli_flags_generated_from_fields() -> None:
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser, EngineSettings)
    add_cli_arguments(parser, ServerSettings)
    args = parser.parse_args(["--expert-cache-gb", "1.5", "--prefetch", "--dtype", "float16", "--port", "9"])
    s = settings_from_args(EngineSettings, args)
    assert (s.expert_cache_gb, s.prefetch, s.dtype) == (1.5, True, "float16")
    assert settings_from_args(ServerSettings, args).port == 9
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "float8"])


def test_llm_rejects_unknown_keyword(tiny_checkpoint) -> None:
    from moeserve import LLM

    with pytest.raises(ConfigError, match="did you mean 'max_num_seqs'"):
        LLM(str(tiny_checkpoint("qwen3_moe")), max_num_seq=2)


def test_cli_rejects_unknown_env(tiny_checkpoint, monkeypatch, capsys) -> None:
    from moeserve.cli import main

    monkeypatch.setenv("MOESERVE_NVFP4_GEMM_BACKEND", "cutlass")
    code = main(["generate", str(tiny_checkpoint("qwen3_moe")), "--skip-tokenizer-init",
                 "--prompt-token-ids", "1"])
    assert code == 1
    assert "unknown environment variable MOESERVE_NVFP4_GEMM_BACKEND" in capsys.readouterr().err
