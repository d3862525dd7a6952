"""A real agent framework (LangChain's ChatOpenAI with a bound tool) drives a tool loop against `moeserve serve` (a
child process) on a tiny random model with Qwen3's template, bounded in steps and time.

The first step forces the call (tool_choice naming the tool: the grammar makes the random model write a valid one);
the framework parses it, the test runs the tool and sends its result back as a role "tool" message; later steps let
the model choose (tool_choice auto), and the loop ends when an answer comes without calls. Thinking is switched off
(enable_thinking false): a random model left to reason would rarely close its <think>.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, ConfigDict, Field

from moeserve.bench.checkpoints import write_tiny_checkpoint
from tests.server.conftest import MODEL_NAME, start_subprocess_server, stop_subprocess_server, wait_healthy
from tests.server.test_chat_tools import QWEN3_TEMPLATE, _model_folder

MAX_STEPS = 4
REQUEST_TIMEOUT_S = 300  # one request on a loaded 2-core machine; fails loudly when exceeded
READY_TIMEOUT_S = 900  # the server's start (a first kernel build included); fails loudly when exceeded


class WeatherArgs(BaseModel):
    # bounded, so that a random model's forced call ends within max_tokens (the grammar enforces the bounds)
    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=12, description="The city")
    days: int = Field(ge=1, le=7, description="How many days")


@tool(args_schema=WeatherArgs)
def get_weather(city: str, days: int) -> str:
    """The weather forecast of a city for a number of days."""
    return f"{days} days of sun in {city}"


@pytest.mark.slow
def test_langchain_tool_loop_against_moeserve_serve(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    folder = _model_folder(tmp_path / "model", QWEN3_TEMPLATE)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    write_tiny_checkpoint(folder, "qwen3_moe", vocab_size=tok.get_vocab_size(),
                          eos_token_id=tok.token_to_id("<|im_end|>"), max_position_embeddings=4096)
    proc, url = start_subprocess_server(folder, "--max-num-seqs", "2")
    try:
        wait_healthy(url, READY_TIMEOUT_S, proc)
        llm = ChatOpenAI(base_url=url + "/v1", api_key="none", model=MODEL_NAME, max_retries=0,  # type: ignore[arg-type]
                         timeout=REQUEST_TIMEOUT_S, temperature=1.0, seed=0, max_tokens=200,  # type: ignore[call-arg]
                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        # strict: the schema as sent keeps additionalProperties false (LangChain drops it otherwise)
        forced = llm.bind_tools([get_weather], tool_choice="get_weather", strict=True)
        free = llm.bind_tools([get_weather], strict=True)
        messages: list[BaseMessage] = [HumanMessage("What is the weather in Paris for the next 3 days?")]
        results: list[ToolMessage] = []
        for step in range(MAX_STEPS):
            reply = (forced if step == 0 else free).invoke(messages)
            assert isinstance(reply, AIMessage)
            messages.append(reply)
            if not reply.tool_calls:
                break
            assert not reply.invalid_tool_calls, reply.invalid_tool_calls
            for call in reply.tool_calls:
                assert call["name"] == "get_weather" and call["id"]
                result = get_weather.invoke(call)  # validates the arguments against the tool's signature
                assert isinstance(result, ToolMessage) and result.tool_call_id == call["id"]
                results.append(result)
                messages.append(result)
        assert results, "the forced first step made no call"
        prompts = [m.response_metadata["token_usage"]["prompt_tokens"] for m in messages if isinstance(m, AIMessage)]
        assert prompts == sorted(prompts) and len(set(prompts)) == len(prompts)  # each step's prompt holds the last
        assert isinstance(messages[-1], AIMessage) and not messages[-1].tool_calls, \
            f"no answer without calls within {MAX_STEPS} steps"
    finally:
        stop_subprocess_server(proc)
