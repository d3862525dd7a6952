"""gpt-oss (harmony) structured output and forced tool calls on a real engine: a tiny random gpt-oss with the
o200k-harmony vocabulary and no tokenizer.json, so the grammar compiler is built from the harmony vocabulary.
Each output is the grammar's work alone and is validated with jsonschema."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.server.conftest import MODEL_NAME, ThreadServer, engine_factory, make_state
from tests.server.test_harmony import tiny_gpt_oss  # noqa: F401  (a fixture)
from tests.server.test_structured_output import SCHEMAS, _format
from tests.server.test_tool_formats import SCHEMAS as TOOL_SCHEMAS
from tests.server.test_tool_formats import TOOLS

ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def gpt_oss_server(tiny_gpt_oss: Path) -> Iterator[ThreadServer]:  # noqa: F811
    server = ThreadServer(make_state(engine_factory(tiny_gpt_oss, skip_tokenizer_init=True, max_num_seqs=4)))
    yield server
    server.stop()


@pytest.mark.slow
def test_json_schema_twenty_samples_at_temperature_1(gpt_oss_server: ThreadServer) -> None:
    client = gpt_oss_server.client()
    schema = SCHEMAS[1]
    for seed in range(20):
        kwargs: Any = dict(model=MODEL_NAME, messages=ASK, max_tokens=150, temperature=1.0, seed=seed,
                           response_format=_format(schema))
        if seed % 2:
            chunks = client.chat.completions.create(stream=True, **kwargs)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            message = client.chat.completions.create(**kwargs).choices[0].message
            text = message.content or ""
            assert message.tool_calls is None or message.tool_calls == []
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.slow
def test_forced_calls_follow_the_schema(gpt_oss_server: ThreadServer) -> None:
    client = gpt_oss_server.client()
    choices: list[Any] = ["required", {"type": "function", "function": {"name": "get_weather"}},
                          {"type": "function", "function": {"name": "get_time"}}]
    for tool_choice in choices:
        for seed in range(3):
            choice = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS,  # type: ignore
                                                    tool_choice=tool_choice, max_tokens=150, temperature=1.0,
                                                    seed=seed).choices[0]
            assert choice.finish_reason == "tool_calls", choice
            calls = choice.message.tool_calls or []
            assert len(calls) == 1
            name = calls[0].function.name  # type: ignore[union-attr]
            assert isinstance(tool_choice, str) or name == tool_choice["function"]["name"]
            jsonschema.validate(json.loads(calls[0].function.arguments), TOOL_SCHEMAS[name])  # type: ignore[union-attr]
