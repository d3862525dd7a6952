"""/v1/responses with the official `openai` client (`client.responses.create`), on harmony (gpt-oss), Qwen3.5's and
GLM-4.5's chat templates, with a fake engine that "generates" a scripted output: reasoning items, output text,
function calls and their round trip (the next turn's prompt is the one chat completions renders for the same
conversation), streamed events in their order with sequence numbers, text.format json_schema, previous_response_id
and its bounded store, and unknown fields refused with a "did you mean"."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from moeserve.server.responses.convert import IGNORED, input_messages
from moeserve.server.responses.protocol import ResponsesRequest
from moeserve.server.responses.store import ResponseStore
from tests.server.agent_api_servers import WEATHER, Served, check_disconnect_aborts, serve_format
from tests.server.conftest import MODEL_NAME

TOOL = {"type": "function", **WEATHER["function"]}  # the Responses shape: flat


@pytest.fixture(scope="module", params=["harmony", "qwen3_5", "glm"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from serve_format(request.param, tmp_path_factory)


def create(s: Served, **kwargs: Any) -> Any:
    return s.server.client().responses.create(**{"model": MODEL_NAME, "max_output_tokens": 200, **kwargs})


def streamed(s: Served, **kwargs: Any) -> tuple[list[Any], Any]:
    """(every event, the response of the last one)."""
    events = list(create(s, stream=True, **kwargs))
    return events, events[-1].response


def test_plain_reasoning_and_text(served: Served) -> None:
    served.say(served.scripts.answer)
    r = create(served, input="Hi", instructions="Be brief.")
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == served.scripts.reasoning
    assert r.output_text == served.scripts.content and r.status == "completed"
    assert r.usage.input_tokens == len(served.engine.prompts[-1]) and r.usage.output_tokens > 0
    assert r.id.startswith("resp_") and r.model == MODEL_NAME and r.instructions == "Be brief."


def test_stream_events_in_order(served: Served) -> None:
    served.say(served.scripts.answer)
    events, final = streamed(served, input="Hi")
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed"
    # reasoning item, then message item: each added, its part added, deltas, done, part done, item done
    expected = ["response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
                "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
                "response.output_item.added", "response.content_part.added", "response.output_text.delta",
                "response.output_text.done", "response.content_part.done", "response.output_item.done"]
    deduped = [k for i, k in enumerate(kinds[2:-1]) if i == 0 or k != kinds[2:-1][i - 1]]
    assert deduped == expected
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert (reasoning, text) == (served.scripts.reasoning, served.scripts.content)
    assert final.output_text == text and final.status == "completed"
    message = [e for e in events if e.type == "response.output_item.done"][-1].item
    assert message.id == final.output[1].id and message.content[0].text == text


def test_tool_round_trip(served: Served) -> None:
    """A function call, then its output sent back: the second prompt is what chat completions renders for the same
    conversation (reasoning, call and result included)."""
    served.say(served.scripts.call)
    first = create(served, input="Weather in Paris?", tools=[TOOL])
    call = first.output[-1]
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    assert json.loads(call.arguments) == served.scripts.arguments and first.status == "completed"
    events, final = streamed(served, input="Weather in Paris?", tools=[TOOL])
    assert [i.type for i in final.output] == [i.type for i in first.output]
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == call.arguments
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == call.arguments

    served.say(served.scripts.answer)
    items = [{"role": "user", "content": "Weather in Paris?"}, *[i.model_dump(exclude_none=True) for i in first.output],
             {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    second = create(served, input=items, tools=[TOOL])
    assert second.output_text == served.scripts.content
    responses_prompt = served.engine.prompts[-1]
    chat = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "reasoning_content": served.scripts.call_reasoning,
             "tool_calls": [{"id": call.call_id, "type": "function",
                             "function": {"name": "get_weather", "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}]
    served.server.client().chat.completions.create(model=MODEL_NAME, messages=chat, tools=[WEATHER], max_tokens=200)
    assert responses_prompt == served.engine.prompts[-1]


def test_previous_response_id_continues_the_conversation(served: Served) -> None:
    served.say(served.scripts.call)
    first = create(served, input="Weather in Paris?", tools=[TOOL])
    served.say(served.scripts.answer)
    output = [{"type": "function_call_output", "call_id": first.output[-1].call_id, "output": "sunny"}]
    chained = create(served, input=output, tools=[TOOL], previous_response_id=first.id)
    chained_prompt = served.engine.prompts[-1]
    items = [{"role": "user", "content": "Weather in Paris?"}, *[i.model_dump(exclude_none=True) for i in first.output],
             *output]
    create(served, input=items, tools=[TOOL])
    assert chained.previous_response_id == first.id and chained_prompt == served.engine.prompts[-1]
    client = served.server.client()
    assert client.responses.retrieve(chained.id).model_dump() == chained.model_dump()
    client.responses.delete(chained.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(chained.id)
    unstored = create(served, input="Hi", store=False)
    with pytest.raises(openai.BadRequestError, match="not found") as err:
        create(served, input="Again", previous_response_id=unstored.id)
    assert err.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_text_format_json_schema(served: Served) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    answer = '{"city": "Paris"}'
    served.say(f"{answer}<|return|>" if served.name == "harmony" else  # the prompt opens harmony's final channel
               "Paris.\n</think>\n\n" + answer if served.name == "qwen3_5" else "\n<think>Paris.</think>\n" + answer)
    fmt = {"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}}
    r = create(served, input="Which city?", text=fmt)
    assert json.loads(r.output_text) == {"city": "Paris"}
    assert served.engine.grammar_specs[-1].value == schema  # the constraint the engine was given
    with pytest.raises(openai.BadRequestError, match="did you mean 'schema'"):
        create(served, input="Which city?", text={"format": {"type": "json_schema", "name": "c", "shema": schema}})


def test_unknown_fields_are_refused_with_a_did_you_mean(served: Served) -> None:
    with pytest.raises(openai.BadRequestError, match="did you mean 'max_output_tokens'") as err:
        create(served, input="Hi", extra_body={"max_output_token": 5})
    assert err.value.body["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="only function tools"):
        create(served, input="Hi", tools=[{"type": "web_search"}])
    with pytest.raises(openai.BadRequestError, match="background"):
        create(served, input="Hi", background=True)
    with pytest.raises(openai.BadRequestError, match="maximum context length") as err:
        create(served, input="Hi", max_output_tokens=10**6)
    assert err.value.body["param"] == "max_output_tokens"  # type: ignore[index]  # this API's name, not chat's
    with pytest.raises(openai.BadRequestError, match="input_image"):
        create(served, input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}])


def test_models_retrieve(served: Served) -> None:
    client = served.server.client()
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-5")
    assert err.value.body["code"] == "model_not_found"  # type: ignore[index]


# ------------------------------------------------------------------------------------------- without a server
def test_ignored_fields_are_known() -> None:
    for name in IGNORED:
        assert name.split(".")[0].removesuffix("[]") in ResponsesRequest.model_fields, name


def test_items_in_a_row_make_one_assistant_message() -> None:
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "R"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "A"}]},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "ok"},
             {"type": "reasoning", "summary": [{"type": "summary_text", "text": "S"}]},
             {"type": "message", "role": "assistant", "content": "B"}]
    assert input_messages(items) == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "A", "reasoning": "R",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        {"role": "assistant", "content": "B", "reasoning": "S"}]


def test_store_is_bounded_by_count_and_bytes() -> None:
    store = ResponseStore(max_count=2, max_bytes=130)  # each entry below: 59 bytes of JSON
    message = [{"role": "user", "content": "x" * 20}]
    for i in range(3):
        assert store.put(f"r{i}", message, {})
    found = store.get("r2")
    assert store.get("r0") is None and found is not None and found.messages == message and len(store) == 2
    assert not store.put("big", [{"role": "user", "content": "x" * 200}], {}) and len(store) == 2
    store.put("r3", [{"role": "user", "content": "y" * 60}], {})  # 99 bytes: the oldest leave until it fits
    assert store.get("r1") is None and store.get("r3") is not None and store.bytes <= 130
    assert store.delete("r3") and store.bytes == 0 and not store.delete("r3")


def test_a_client_that_leaves_a_stream_aborts_its_request(served: Served) -> None:
    check_disconnect_aborts(served, "/v1/responses", {"model": MODEL_NAME, "input": "Hi", "stream": True,
                                                      "max_output_tokens": 3000})


def test_a_cut_at_max_output_tokens_is_incomplete(served: Served) -> None:
    served.say(served.scripts.answer)
    r = create(served, input="Hi", max_output_tokens=6)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    events, final = streamed(served, input="Hi", max_output_tokens=6)
    assert events[-1].type == "response.incomplete" and final.incomplete_details.reason == "max_output_tokens"
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.status for i in done] == [i.status for i in final.output] == [i.status for i in r.output]
    assert done and done[-1].status == "incomplete"
