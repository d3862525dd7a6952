"""Every start-up choice is recorded once (LLMEngine.choices, read-only), printed in the log at INFO, and exposed by the
server in /v1/models (`startup_choices`) and /metrics (`moeserve:startup_choice{name=...,value=...} 1`)."""

from __future__ import annotations

import logging

import httpx
import pytest

from moeserve import LLM
from tests.server.conftest import ThreadServer
from tests.server.test_metrics import scrape

EXPECTED = ("device", "dtype", "threads", "kernels", "max_model_len", "memory", "placement", "expert layout",
            "experts", "host tier", "KV cache", "expert store", "expert kernel", "decode step", "batch invariance", "attention")


def test_engine_records_every_choice_as_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="moeserve"):
        llm = LLM()  # the bundled demo model
    choices = llm.engine.choices
    assert set(EXPECTED) <= set(choices)
    logged = {r.getMessage() for r in caplog.records if r.name == "moeserve.choices" and r.levelno == logging.INFO}
    for name, text in choices.items():
        assert f"{name}: {text}" in logged  # the record is what the log printed, at the default level
    # the attention line names the path that runs: the C++ op for every token when the kernels are on (the default
    # batch-invariant mode), torch's attention otherwise
    cpp = choices["kernels"].startswith("cpp")
    assert ("C++ decode_attention for every token" in choices["attention"]) == cpp
    assert ("torch scaled_dot_product_attention" in choices["attention"]) == (not cpp)
    with pytest.raises(TypeError):
        choices["device"] = "elsewhere"  # type: ignore[index]
    llm.engine.close()


def test_server_exposes_the_choices(live_server: ThreadServer) -> None:
    plain = httpx.get(live_server.url + "/v1/models").json()["data"][0]
    assert "startup_choices" not in plain and str(live_server.state.llm.checkpoint.path) not in str(plain)
    card = httpx.get(live_server.url + "/v1/models?verbose=true").json()["data"][0]
    engine_choices = dict(live_server.state.engine.startup_choices())
    assert card["startup_choices"] == engine_choices and set(EXPECTED) <= set(engine_choices)
    samples = scrape(live_server.url)
    exposed = {k for k, v in samples.items() if k.startswith("moeserve:startup_choice{") and v == 1}
    assert len(exposed) == len(engine_choices)
    assert any('name="expert kernel"' in k for k in exposed)
