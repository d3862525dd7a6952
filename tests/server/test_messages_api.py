"""/v1/messages with the official `anthropic` client (`client.messages.create`), on harmony (gpt-oss), Qwen3.5's and
GLM-4.5's chat templates, with a fake engine that "generates" a scripted output: thinking, text and tool_use blocks,
a tool_use round trip (the next turn's prompt is the one chat completions renders for the same conversation),
Anthropic's streamed events, stop sequences, the thinking switch, errors in Anthropic's shape, x-api-key."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest

from moeserve.server.messages.convert import IGNORED
from moeserve.server.messages.protocol import MessagesRequest
from tests.server.agent_api_servers import WEATHER, Served, check_disconnect_aborts, serve_format
from tests.server.conftest import MODEL_NAME, ThreadServer, make_state
from tests.server.test_chat_tools import hf_prompt

TOOL = {"name": "get_weather", "description": WEATHER["function"]["description"],
        "input_schema": WEATHER["function"]["parameters"]}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module", params=["harmony", "qwen3_5", "glm"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from serve_format(request.param, tmp_path_factory)


def client(server: ThreadServer, **kwargs: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=kwargs.pop("api_key", "none"), max_retries=0, **kwargs)


def create(s: Served, **kwargs: Any) -> Any:
    return client(s.server).messages.create(**{"model": MODEL_NAME, "max_tokens": 200, "messages": ASK, **kwargs})


def blocks(message: Any) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for b in message.content:
        out.append((b.type, b.thinking if b.type == "thinking" else b.text if b.type == "text" else (b.name, b.input)))
    return out


def test_plain_thinking_and_text(served: Served) -> None:
    served.say(served.scripts.answer)
    m = create(served, system="Be brief.")
    assert blocks(m) == [("thinking", served.scripts.reasoning), ("text", served.scripts.content)]
    assert m.stop_reason == "end_turn" and m.role == "assistant" and m.model == MODEL_NAME
    assert m.usage.input_tokens == len(served.engine.prompts[-1]) and m.usage.output_tokens > 0


def test_stream_events(served: Served) -> None:
    served.say(served.scripts.call)
    with client(served.server).messages.stream(model=MODEL_NAME, max_tokens=200, messages=ASK, tools=[TOOL]) as s:
        events = list(s)
        final = s.get_final_message()
    kinds = [e.type for e in events if not e.type.endswith(("text", "thinking", "input_json", "signature"))]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "tool_use"]
    assert kinds.count("content_block_stop") == 2
    deltas = {e.delta.type for e in events if e.type == "content_block_delta"}
    assert deltas == {"thinking_delta", "input_json_delta"}
    assert blocks(final) == [("thinking", served.scripts.call_reasoning),
                             ("tool_use", ("get_weather", served.scripts.arguments))]
    assert final.stop_reason == "tool_use" and final.usage.output_tokens > 0
    assert blocks(final) == blocks(create(served, tools=[TOOL]))


def test_tool_use_round_trip(served: Served) -> None:
    served.say(served.scripts.call)
    first = create(served, tools=[TOOL], tool_choice={"type": "auto"})
    use = first.content[-1]
    assert use.type == "tool_use" and first.stop_reason == "tool_use"
    served.say(served.scripts.answer)
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}
    second = create(served, tools=[TOOL], messages=[*ASK, {"role": "assistant", "content": first.content}, result])
    assert blocks(second)[-1] == ("text", served.scripts.content)
    messages_prompt = served.engine.prompts[-1]
    chat = [*ASK, {"role": "assistant", "content": "", "reasoning_content": served.scripts.call_reasoning,
                   "tool_calls": [{"id": use.id, "type": "function", "function": {
                       "name": "get_weather", "arguments": json.dumps(use.input)}}]},
            {"role": "tool", "tool_call_id": use.id, "content": "sunny"}]
    served.server.client().chat.completions.create(model=MODEL_NAME, messages=chat, tools=[WEATHER], max_tokens=200)
    assert messages_prompt == served.engine.prompts[-1]


def test_stop_sequences_and_max_tokens(served: Served) -> None:
    served.say(served.scripts.answer)
    cut = create(served, max_tokens=2)
    assert cut.stop_reason == "max_tokens"
    if served.name != "harmony":  # harmony's text is decoded from its tokens, not cut at stop strings here
        m = create(served, stop_sequences=["sunny"])
        assert m.stop_reason == "stop_sequence" and m.stop_sequence == "sunny"
        assert blocks(m)[-1][1].startswith("It is ")  # (this fake engine does not hold back a stop string's start)


def test_errors_in_anthropics_shape(served: Served) -> None:
    with pytest.raises(anthropic.BadRequestError) as err:
        create(served, extra_body={"stop_sequence": ["x"]})
    body = err.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "did you mean 'stop_sequences'" in body["error"]["message"]  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError, match="did you mean 'input_schema'"):
        create(served, tools=[{"name": "f", "input_shema": {}}])
    with pytest.raises(anthropic.BadRequestError, match="image"):
        create(served, messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}])
    with pytest.raises(anthropic.BadRequestError, match="prefill"):
        create(served, messages=[*ASK, {"role": "assistant", "content": "It is"}])
    with pytest.raises(anthropic.NotFoundError) as missing:
        create(served, model="claude-sonnet-4-5")
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        client(served.server).post("/v1/messages", body={"model": MODEL_NAME, "messages": ASK}, cast_to=object)


def test_thinking_switch_reaches_the_template(tmp_path_factory: pytest.TempPathFactory) -> None:
    """thinking disabled / enabled is the template's enable_thinking (Qwen3.5: the prompt closes or opens <think>)."""
    for s in serve_format("qwen3_5", tmp_path_factory):
        s.say("It is sunny.")
        off = create(s, thinking={"type": "disabled"})
        assert blocks(off) == [("text", "It is sunny.")]
        assert s.engine.prompts[-1] == hf_prompt(Path(s.engine.checkpoint.path), ASK, enable_thinking=False)
        s.say(s.scripts.answer)
        on = create(s, thinking={"type": "enabled", "budget_tokens": 1024})
        assert blocks(on)[0] == ("thinking", s.scripts.reasoning)
        assert s.engine.prompts[-1] == hf_prompt(Path(s.engine.checkpoint.path), ASK, enable_thinking=True)


def test_x_api_key(tmp_path: Path) -> None:
    from tests.server.test_chat_tools import QWEN3_5_TEMPLATE, ScriptedTextEngine, _model_folder

    engine = ScriptedTextEngine(_model_folder(tmp_path, QWEN3_5_TEMPLATE))
    engine.script = "It is sunny."
    server = ThreadServer(make_state(lambda: engine, api_key="sesame"))
    try:
        m = client(server, api_key="sesame").messages.create(model=MODEL_NAME, max_tokens=20, messages=ASK,
                                                             thinking={"type": "disabled"})
        assert blocks(m) == [("text", "It is sunny.")]
        with pytest.raises(anthropic.AuthenticationError) as err:
            client(server, api_key="wrong").messages.create(model=MODEL_NAME, max_tokens=20, messages=ASK)
        assert err.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    finally:
        server.stop()


def test_ignored_fields_are_known() -> None:
    for name in IGNORED:
        top = name.split(".")[0].removesuffix("[]")
        assert top in MessagesRequest.model_fields, name


def test_a_client_that_leaves_a_stream_aborts_its_request(served: Served) -> None:
    check_disconnect_aborts(served, "/v1/messages", {"model": MODEL_NAME, "messages": ASK, "stream": True,
                                                     "max_tokens": 3000})


def test_count_tokens_is_the_prompt_messages_would_take(served: Served) -> None:
    served.say(served.scripts.answer)
    m = create(served, system="Be brief.", tools=[TOOL])
    count = client(served.server).messages.count_tokens(model=MODEL_NAME, messages=ASK, system="Be brief.",
                                                        tools=[TOOL])
    assert count.input_tokens == m.usage.input_tokens == len(served.engine.prompts[-1])
    with pytest.raises(anthropic.BadRequestError, match="did you mean 'messages'"):
        client(served.server).post("/v1/messages/count_tokens", body={"model": MODEL_NAME, "mesages": ASK},
                                   cast_to=object)
