"""The Responses and Messages APIs against `moeserve serve` (a child process) on tiny random models: the official
`openai` client's responses.create and the `anthropic` client's messages.create, plain, streamed, a tool round
trip (the first call forced by tool_choice: the grammar makes the random model write a valid one) and structured
output; and an agent framework that speaks Responses (the OpenAI Agents SDK) driving a two-step tool loop.

Chat formats: Qwen3.5's and GLM-4.5's templates on a tiny Qwen3-MoE with the test tokenizer, and harmony on a
tiny gpt-oss. Thinking is switched off where the template has the switch (a random model left to reason would
rarely close its <think>), except in the test of the thinking switch itself."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from moeserve.bench.checkpoints import write_tiny_checkpoint
from tests.server.agent_api_servers import TEMPLATES
from tests.server.conftest import MODEL_NAME, start_subprocess_server, stop_subprocess_server, wait_healthy
from tests.server.test_chat_tools import QWEN3_5_TEMPLATE, _model_folder

READY_TIMEOUT_S = 900  # the server's start (a first kernel build included); fails loudly when exceeded
REQUEST_TIMEOUT_S = 300  # one request on a loaded 2-core machine
# bounded, so that a random model's forced call ends within max tokens (the grammar enforces the bounds)
ARGS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "description": "The weather of a city",
                  "parameters": ARGS, "strict": True}
MESSAGES_TOOL = {"name": "get_weather", "description": "The weather of a city", "input_schema": ARGS}


class Live:
    def __init__(self, url: str, name: str) -> None:
        self.url, self.name = url, name
        self.openai = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=REQUEST_TIMEOUT_S)
        self.anthropic = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=REQUEST_TIMEOUT_S)
        harmony = name == "harmony"
        self.no_thinking: dict[str, Any] = {} if harmony else {"chat_template_kwargs": {"enable_thinking": False}}
        self.thinking_off: dict[str, Any] = {} if harmony else {"thinking": {"type": "disabled"}}


def _folder(name: str, root: Path) -> Path:
    if name == "harmony":
        from tests.server.test_harmony import tiny_gpt_oss

        return tiny_gpt_oss.__wrapped__(_Factory(root))  # type: ignore[attr-defined]
    from tokenizers import Tokenizer

    template = QWEN3_5_TEMPLATE if name == "qwen3_5" else (TEMPLATES / "glm4_5.jinja").read_text()
    folder = _model_folder(root / "model", template)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    write_tiny_checkpoint(folder, "qwen3_moe", vocab_size=tok.get_vocab_size(),
                          eos_token_id=tok.token_to_id("<|im_end|>"), max_position_embeddings=4096)
    return folder


class _Factory:
    def __init__(self, root: Path) -> None:
        self.root = root

    def mktemp(self, name: str) -> Path:
        path = self.root / name
        path.mkdir()
        return path


@pytest.fixture(scope="module", params=["qwen3_5", "glm", "harmony"])
def live(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    folder = _folder(request.param, tmp_path_factory.mktemp(request.param))
    extra = ("--skip-tokenizer-init",) if request.param == "harmony" else ()
    proc, url = start_subprocess_server(folder, "--max-num-seqs", "2", *extra)
    try:
        wait_healthy(url, READY_TIMEOUT_S, proc)
        yield Live(url, request.param)
    finally:
        stop_subprocess_server(proc)


@pytest.mark.slow
def test_responses_plain_and_streamed(live: Live) -> None:
    r = live.openai.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=8, temperature=0,
                                     extra_body=live.no_thinking)
    assert r.status in ("completed", "incomplete") and r.usage.output_tokens >= 1
    events = list(live.openai.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=8, temperature=0,
                                               stream=True, extra_body=live.no_thinking))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    final = events[-1].response
    assert final.usage.output_tokens == r.usage.output_tokens  # greedy: the same output
    assert [i.model_dump(exclude={"id"}) for i in final.output] == [i.model_dump(exclude={"id"}) for i in r.output]


@pytest.mark.slow
def test_responses_tool_round_trip_and_json_schema(live: Live) -> None:
    first = live.openai.responses.create(model=MODEL_NAME, input="Weather in Paris for 3 days?",
                                         tools=[RESPONSES_TOOL], tool_choice="required", max_output_tokens=200,
                                         extra_body={"seed": 0, **live.no_thinking})
    call = first.output[-1]
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), ARGS)
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    second = live.openai.responses.create(model=MODEL_NAME, input=[output], previous_response_id=first.id,
                                          tools=[RESPONSES_TOOL], max_output_tokens=8, extra_body=live.no_thinking)
    assert second.usage.input_tokens > first.usage.input_tokens  # the stored conversation, the call and its result
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
              "additionalProperties": False}
    r = live.openai.responses.create(model=MODEL_NAME, input="Which city?", max_output_tokens=100,
                                     text={"format": {"type": "json_schema", "name": "city", "schema": schema}},
                                     extra_body={"seed": 0, **live.no_thinking})
    jsonschema.validate(json.loads(r.output_text), schema)


@pytest.mark.slow
def test_messages_plain_streamed_and_tool_use(live: Live) -> None:
    # (the anthropic client no longer has sampling parameters; the server still takes temperature, top_p, top_k)
    m = live.anthropic.messages.create(model=MODEL_NAME, max_tokens=8, extra_body={"temperature": 0},
                                       messages=[{"role": "user", "content": "Hi"}], system="Be brief.",
                                       **live.thinking_off)
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens >= 1
    with live.anthropic.messages.stream(model=MODEL_NAME, max_tokens=8, extra_body={"temperature": 0},
                                        messages=[{"role": "user", "content": "Hi"}], system="Be brief.",
                                        **live.thinking_off) as s:
        streamed = s.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in m.content]
    ask = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
    used = live.anthropic.messages.create(model=MODEL_NAME, max_tokens=200, messages=ask, tools=[MESSAGES_TOOL],
                                          tool_choice={"type": "tool", "name": "get_weather"}, **live.thinking_off)
    use = used.content[-1]
    assert used.stop_reason == "tool_use" and use.type == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, ARGS)
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}
    answer = live.anthropic.messages.create(model=MODEL_NAME, max_tokens=8, tools=[MESSAGES_TOOL], **live.thinking_off,
                                            messages=[*ask, {"role": "assistant", "content": used.content}, result])
    assert answer.usage.input_tokens > used.usage.input_tokens


@pytest.mark.slow
def test_messages_thinking(live: Live) -> None:
    """thinking enabled on a reasoning template: the output opens with a thinking block (Qwen3.5 opens <think> in
    the prompt; harmony starts in its analysis channel; GLM's model writes <think> itself, which a random model
    need not: there only the request is checked)."""
    m = live.anthropic.messages.create(model=MODEL_NAME, max_tokens=8, extra_body={"temperature": 0},
                                       thinking={"type": "enabled", "budget_tokens": 1024},
                                       messages=[{"role": "user", "content": "Hi"}])
    assert m.usage.output_tokens >= 1
    if live.name == "qwen3_5":
        assert m.content[0].type == "thinking" and m.content[0].thinking


class _Answer(BaseModel):
    model_config = ConfigDict(extra="forbid")
    answer: str = Field(max_length=16)


@pytest.mark.slow
def test_openai_agents_two_step_tool_loop(live: Live) -> None:
    """The OpenAI Agents SDK (Responses API): step one calls the tool (forced), the SDK runs it and sends its result
    back; step two (tool_choice reset by the SDK) answers. A random model writes no end of turn by itself, so step
    two's answer is held to a short JSON schema (with tool_choice none), which ends it."""
    if live.name != "qwen3_5":
        pytest.skip("one chat format is enough for the framework loop")
    import asyncio

    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from agents.agent_output import AgentOutputSchema

    class AnswersAfterTheTool(OpenAIResponsesModel):
        async def get_response(self, system_instructions: Any, input: Any, model_settings: Any, tools: Any,
                               output_schema: Any, *args: Any, **kwargs: Any) -> Any:
            if any(isinstance(item, dict) and item.get("type") == "function_call_output" for item in input):
                model_settings = model_settings.resolve(ModelSettings(tool_choice="none"))
                output_schema = AgentOutputSchema(_Answer)
            return await super().get_response(system_instructions, input, model_settings, tools, output_schema,
                                              *args, **kwargs)

    set_tracing_disabled(True)
    calls: list[tuple[str, int]] = []

    @function_tool(strict_mode=True)
    def get_weather(city: str, days: int) -> str:
        """The weather forecast of a city for a number of days."""
        calls.append((city, days))
        return f"{days} days of sun in {city}"

    get_weather.params_json_schema = ARGS
    client = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=REQUEST_TIMEOUT_S)
    agent = Agent(name="weather", instructions="Answer with the tool.", tools=[get_weather],
                  model=AnswersAfterTheTool(MODEL_NAME, client),
                  model_settings=ModelSettings(tool_choice="get_weather", max_tokens=200, temperature=1.0,
                                               extra_body={"seed": 0, **live.no_thinking}))
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris for the next 3 days?", max_turns=2))
    assert len(calls) == 1 and len(result.raw_responses) == 2
    assert _Answer.model_validate_json(result.final_output)
