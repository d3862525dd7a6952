"""`serve` gives a request's unset sampling fields the model's generation_config.json values, as vLLM does
(`generation_config=auto`; `vllm` turns them off; a request's own fields win), so `serve` and `chat` draw the same
first token for the same seed and prompt; and the served names: MODEL as given, or --served-model-name's several."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any

import openai
import pytest

from moeserve.config import ServerSettings, build_settings
from moeserve.engine.async_engine import AsyncEngine
from moeserve.engine.sampling_defaults import server_sampling
from moeserve.errors import ConfigError
from moeserve.server.metrics import ServerMetrics
from moeserve.server.startup import served_names
from moeserve.server.state import ServerState
from tests.server.conftest import ThreadServer, engine_factory

RECOMMENDED = {"temperature": 0.7, "top_p": 0.9, "top_k": 3, "max_new_tokens": 5, "do_sample": False}
SEEDS = range(3)


@pytest.fixture(scope="module")
def recommending_model(tiny_text_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("recommending") / "model"
    shutil.copytree(tiny_text_model, folder)
    (folder / "generation_config.json").write_text(json.dumps(RECOMMENDED))
    return folder


def start(model: Path, names: tuple[str, ...] = ("org/model",), **server: Any) -> ThreadServer:
    settings: ServerSettings = build_settings(ServerSettings, server)
    state = ServerState(AsyncEngine(engine_factory(model), 8), settings, names[0], ServerMetrics(names[0]),
                        aliases=names)
    return ThreadServer(state)


@pytest.fixture(scope="module")
def server(recommending_model: Path) -> Any:
    srv = start(recommending_model, ("org/model", "alias-two"))
    yield srv
    srv.stop()


def first_tokens(client: openai.OpenAI, model: str = "org/model", **extra: Any) -> list[str]:
    out = []
    for seed in SEEDS:
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                               seed=seed, max_tokens=1, **extra)
        out.append(reply.choices[0].message.content or "")
    return out


def test_serve_and_chat_draw_the_same_first_token(server: ThreadServer, recommending_model: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture) -> None:
    from moeserve.cli import main

    served = first_tokens(server.client())
    chatted = []
    for seed in SEEDS:
        monkeypatch.setattr("sys.stdin", io.StringIO("Hi\n"))
        assert main(["chat", str(recommending_model), "--dtype", "float32", "--threads", "1", "--seed", str(seed),
                     "--max-tokens", "1"]) == 0
        out = capsys.readouterr()
        assert "sampling: temperature 0.7, top_p 0.9, top_k 3 (generation_config.json), max_tokens 1 (flag)" in out.err
        chatted.append(out.out.rstrip("\n"))
    assert served == chatted
    card = server.client().models.list().data[0].model_dump()
    assert "sampling_defaults" not in card  # the plain record; ?verbose=true has them
    verbose = server.client().get("/models", cast_to=object, options={"params": {"verbose": "true"}})
    assert verbose["data"][0]["sampling_defaults"] == {"temperature": 0.7, "top_p": 0.9, "top_k": 3, "max_tokens": 5}


def test_request_fields_win_and_max_new_tokens_is_the_default_length(server: ThreadServer) -> None:
    client = server.client()
    reply = client.completions.create(model="org/model", prompt="Once upon a time", seed=1)
    assert reply.usage.completion_tokens == 5 and reply.choices[0].finish_reason == "length"  # max_new_tokens
    longer = client.completions.create(model="org/model", prompt="Once upon a time", seed=1, max_tokens=7,
                                       temperature=0)
    assert longer.usage.completion_tokens == 7
    greedy = client.completions.create(model="org/model", prompt="Once upon a time", max_tokens=7, temperature=0)
    assert greedy.choices[0].text == longer.choices[0].text  # temperature 0 wins over the file's 0.7


def test_generation_config_vllm_turns_the_defaults_off(recommending_model: Path) -> None:
    srv = start(recommending_model, generation_config="vllm")
    try:
        assert srv.state.sampling_defaults().values == {}
        reply = srv.client().completions.create(model="org/model", prompt="Once upon a time", max_tokens=None,
                                                temperature=0)
        assert reply.usage.completion_tokens > 5  # no max_new_tokens: the context's end or EOS
    finally:
        srv.stop()


def test_generation_config_names_a_folder(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.2, "top_k": 4}))
    chosen = server_sampling(str(tmp_path), {"temperature": 0.9})
    assert chosen.values == {"temperature": 0.2, "top_k": 4}
    assert chosen.sources["temperature"] == str(tmp_path / "generation_config.json")
    with pytest.raises(ConfigError, match="no generation_config.json there"):
        server_sampling(str(tmp_path / "missing"), {})
    assert server_sampling("auto", {"temperature": 0.6, "do_sample": False}).values == {"temperature": 0.6}


# ------------------------------------------------------------------------------------------------ names
def test_served_names_are_model_as_given_or_the_flags() -> None:
    unset: ServerSettings = build_settings(ServerSettings, {})
    assert served_names(unset, "Qwen/Qwen3-30B-A3B") == ("Qwen/Qwen3-30B-A3B", "Qwen3-30B-A3B")
    assert served_names(unset, "/models/gpt-oss-20b/") == ("/models/gpt-oss-20b/", "gpt-oss-20b")
    assert served_names(unset, None) == ("moeserve-demo",)
    several: ServerSettings = build_settings(ServerSettings, {"served_model_name": "a, b a"})
    assert served_names(several, "/models/x") == ("a", "b")
    with pytest.raises(ConfigError):
        build_settings(ServerSettings, {"served_model_name": " , "})


def test_served_model_name_takes_several_names_on_the_command_line() -> None:
    import argparse

    from moeserve.config import add_cli_arguments, settings_from_args

    parser = argparse.ArgumentParser()
    add_cli_arguments(parser, ServerSettings)
    args = parser.parse_args(["--served-model-name", "one", "two", "--port", "9"])
    assert settings_from_args(ServerSettings, args).served_model_name == ["one", "two"]


def test_any_served_name_is_accepted_and_the_first_is_answered(server: ThreadServer) -> None:
    client = server.client()
    assert [m.id for m in client.models.list().data] == ["org/model", "alias-two"]
    assert client.models.retrieve("alias-two").id == "alias-two"
    reply = client.completions.create(model="alias-two", prompt="Hi", max_tokens=1)
    assert reply.model == "org/model"
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="model", prompt="Hi", max_tokens=1)
    assert err.value.code == "model_not_found"
