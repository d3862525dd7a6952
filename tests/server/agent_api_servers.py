"""Scripted servers for the Responses and Messages API tests: one per chat format (harmony, Qwen3.5's template, GLM-4.5's
template), each with a fake engine that "generates" a scripted output, and per format the scripts of an answer
after reasoning and of one tool call, with what they parse into."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from moeserve.server.harmony import load_encoding, vocab_folder
from tests.server.conftest import ThreadServer, make_state
from tests.server.test_chat_tools import QWEN3_5_TEMPLATE, ScriptedTextEngine, _model_folder
from tests.server.test_harmony_chat import ScriptedEngine

TEMPLATES = Path(__file__).parent / "templates"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}


@dataclass
class Scripts:
    answer: str  # reasoning, then the answer
    reasoning: str
    content: str
    call: str  # reasoning, then one call of get_weather
    call_reasoning: str
    arguments: dict[str, Any]


SCRIPTS = {
    "harmony": Scripts(
        "<|channel|>analysis<|message|>The user says hi.<|end|><|start|>assistant<|channel|>final<|message|>"
        "Bonjour !<|return|>", "The user says hi.", "Bonjour !",
        "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
        "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>", "Need weather.",
        {"city": "Paris"}),
    "qwen3_5": Scripts(
        "Paris, so weather.\n</think>\n\nIt is sunny.", "Paris, so weather.", "It is sunny.",
        "The weather tool.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n"
        "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", "The weather tool.",
        {"city": "New York", "days": 3}),
    "glm": Scripts(
        "\n<think>Weather.</think>\nIt is sunny.", "Weather.", "It is sunny.",
        "\n<think>One tool.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>", "One tool.", {"city": "Paris", "days": 2}),
}


@dataclass
class Served:
    name: str
    server: ThreadServer
    engine: Any
    say: Callable[[str], None]  # sets what the engine "generates" next
    scripts: Scripts


def serve_format(name: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    folder = tmp_path_factory.mktemp(name)
    if name == "harmony":
        encoding = load_encoding(str(vocab_folder(None)))
        engine: Any = ScriptedEngine([], folder)

        def say(text: str) -> None:
            engine.script = list(encoding.encode(text, allowed_special="all"))
    else:
        template = QWEN3_5_TEMPLATE if name == "qwen3_5" else (TEMPLATES / "glm4_5.jinja").read_text()
        engine = ScriptedTextEngine(_model_folder(folder, template))

        def say(text: str) -> None:
            engine.script = text
    server = ThreadServer(make_state(lambda: engine))
    yield Served(name, server, engine, say, SCRIPTS[name])
    server.stop()


def check_disconnect_aborts(s: Served, path: str, body: dict[str, Any]) -> None:
    """A client that leaves a stream early: its engine request is aborted (not run to its end)."""
    import time

    import httpx

    aborted: list[str] = []
    abort = s.engine.abort_request
    s.engine.abort_request = lambda rid: (aborted.append(rid), abort(rid))
    if s.name == "harmony":  # its scripted engine takes no time per step: done before the client can leave
        pytest.skip("the scripted harmony engine finishes before the client leaves")
    s.say("Thinking on and on. " * 400)  # thousands of steps (each re-encodes the script): it cannot end first
    try:
        with httpx.stream("POST", s.server.url + path, json=body, timeout=60) as response:
            for line in response.iter_lines():
                if "delta" in line:
                    break
        deadline = time.monotonic() + 30
        while not aborted and time.monotonic() < deadline:
            time.sleep(0.01)
        assert aborted and not s.engine.requests
    finally:
        s.engine.abort_request = abort
