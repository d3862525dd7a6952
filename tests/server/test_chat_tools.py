"""Reasoning and tool calls end to end with the official `openai` client, on the Qwen3 template (JSON tool calls,
`<think>` in the output) and the Qwen3.5 template (XML tool calls, `<think>` opened by the prompt).

A random model does not call tools by itself, so the engine here "generates" a scripted text (one token per step,
with the tiny tokenizer; stop strings and max_tokens honoured). The prompts it receives are compared with
transformers' apply_chat_template on the same conversation."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import openai
import pytest

from moeserve.bench.checkpoints import write_tiny_tokenizer
from moeserve.engine.outputs import CompletionOutput, RequestOutput
from moeserve.tokenizer import Tokenizer
from tests.server.conftest import MODEL_NAME, ThreadServer, make_state
from tests.server.test_harmony_chat import ScriptedEngine

TEMPLATES = Path(__file__).parent / "templates"
QWEN3_TEMPLATE = (TEMPLATES / "qwen3.jinja").read_text()  # Qwen3's published template (tool calls as JSON)
QWEN3_5_TEMPLATE = (TEMPLATES / "qwen3_5.jinja").read_text()  # Qwen3.5's (XML tool calls, <think> in the prompt)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


class ScriptedTextEngine(ScriptedEngine):
    """Emits the tokens of `script` (text here, not token ids) one per step; stops at a stop string (cut, like
    the engine) or max_tokens."""

    script: str  # type: ignore[assignment]
    tokenizer: Tokenizer  # type: ignore[assignment]

    def __init__(self, folder: Path) -> None:
        super().__init__([], folder)
        self.tokenizer = Tokenizer(folder)
        self.checkpoint = SimpleNamespace(config={"model_type": "qwen3_moe"}, path=folder)
        self.script = ""

    def step(self) -> list[RequestOutput]:
        outputs = []
        script = self.tokenizer.encode(self.script, add_special_tokens=False)
        for rid, (prompt, params, out) in list(self.requests.items()):
            out.append(script[len(out)])
            text = self.tokenizer.decode(out, skip_special_tokens=params.skip_special_tokens)
            reason, stop_reason = None, None
            for stop in params.stop_strings:
                if stop in text:
                    text, reason, stop_reason = text[:text.index(stop)], "stop", stop
            if reason is None and len(out) == len(script):
                reason = "stop"
            elif reason is None and len(out) >= (params.max_tokens or 1):
                reason = "length"
            if reason is None:  # a character cut between tokens waits for its last byte, as in the engine
                text = text.rstrip("\ufffd")
            comps = [CompletionOutput(i, text, list(out), None, None, reason, stop_reason) for i in range(params.n)]
            outputs.append(RequestOutput(rid, None, prompt, comps, reason is not None))
            if reason is not None:
                del self.requests[rid]
        return outputs


def _model_folder(folder: Path, template: str) -> Path:
    write_tiny_tokenizer(folder)
    (folder / "chat_template.jinja").write_text(template)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return folder


def _serve(tmp_path_factory: pytest.TempPathFactory, template: str
           ) -> Iterator[tuple[ThreadServer, ScriptedTextEngine]]:
    engine = ScriptedTextEngine(_model_folder(tmp_path_factory.mktemp("model"), template))
    server = ThreadServer(make_state(lambda: engine))
    yield server, engine
    server.stop()


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ThreadServer, ScriptedTextEngine]]:
    yield from _serve(tmp_path_factory, QWEN3_TEMPLATE)


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ThreadServer, ScriptedTextEngine]]:
    yield from _serve(tmp_path_factory, QWEN3_5_TEMPLATE)


def ask(server: ThreadServer, stream: bool, **kwargs: Any) -> dict[str, Any]:
    """One chat completion as {content, reasoning, tool_calls, finish_reason, chunks}; a stream is put together
    the way clients do (arguments concatenated per call index)."""
    client = server.client()
    kwargs = {"model": MODEL_NAME, "messages": ASK, "max_tokens": 200, **kwargs}
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        message = choice.message.model_dump()
        calls = [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"] or []]
        return {"content": message["content"], "reasoning": message.get("reasoning_content"), "tool_calls": calls,
                "finish_reason": choice.finish_reason}
    content = reasoning = ""
    calls: dict[int, list[str]] = {}
    argument_chunks, finish, chunks = 0, None, 0
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        chunks += 1
        delta = chunk.choices[0].delta.model_dump()
        content += delta.get("content") or ""
        reasoning += delta.get("reasoning_content") or ""
        for call in delta.get("tool_calls") or []:
            if call["index"] not in calls:
                assert call["id"] and call["function"]["name"], "the first delta of a call has its id and name"
                calls[call["index"]] = [call["id"], call["function"]["name"], ""]
            else:
                assert call.get("id") is None
            calls[call["index"]][2] += call["function"]["arguments"] or ""
            argument_chunks += bool(call["function"]["arguments"])
        finish = chunk.choices[0].finish_reason or finish
    return {"content": content or None, "reasoning": reasoning or None,
            "tool_calls": [tuple(calls[i]) for i in sorted(calls)], "finish_reason": finish,
            "argument_chunks": argument_chunks}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Streamed and not streamed agree (call ids differ between two requests)."""
    strip = [(name, args) for _, name, args in a["tool_calls"]], [(name, args) for _, name, args in b["tool_calls"]]
    return strip[0] == strip[1] and all(a[k] == b[k] for k in ("content", "reasoning", "finish_reason"))


def hf_prompt(folder: Path, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    from transformers import AutoTokenizer

    out = AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(messages, add_generation_prompt=True,
                                                                         tokenize=True, **kwargs)
    return list(out if isinstance(out, list) else out["input_ids"])


# ------------------------------------------------------------------------------------------------- reasoning
def test_qwen3_reasoning_is_split(qwen3: tuple[ThreadServer, ScriptedTextEngine]) -> None:
    server, engine = qwen3
    engine.script = "<think>\nThe user asks about Paris.\n</think>\n\nIt is sunny."
    for stream in (False, True):
        out = ask(server, stream)
        assert (out["reasoning"], out["content"]) == ("The user asks about Paris.", "It is sunny.")
        assert out["finish_reason"] == "stop" and out["tool_calls"] == []


def test_include_reasoning_false_leaves_the_reasoning_out(qwen3: tuple[ThreadServer, ScriptedTextEngine]) -> None:
    """vLLM's include_reasoning (vllm-router writes it, true): false parses the reasoning out and drops it."""
    server, engine = qwen3
    engine.script = "<think>\nThe user asks about Paris.\n</think>\n\nIt is sunny."
    for stream in (False, True):
        out = ask(server, stream, extra_body={"include_reasoning": False})
        assert out["content"] == "It is sunny." and not out["reasoning"]
        assert ask(server, stream, extra_body={"include_reasoning": True})["reasoning"] == "The user asks about Paris."


def test_qwen3_5_output_starts_inside_the_reasoning(qwen3_5: tuple[ThreadServer, ScriptedTextEngine]) -> None:
    server, engine = qwen3_5
    engine.script = "Paris, so weather.\n</think>\n\nIt is sunny."
    for stream in (False, True):
        out = ask(server, stream)
        assert (out["reasoning"], out["content"]) == ("Paris, so weather.", "It is sunny.")
    assert engine.tokenizer.decode(engine.prompts[-1], skip_special_tokens=False).endswith("<|im_start|>assistant\n<think>\n")


def test_enable_thinking_reaches_the_template(qwen3_5: tuple[ThreadServer, ScriptedTextEngine]) -> None:
    server, engine = qwen3_5
    engine.script = "It is sunny."
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    for stream in (False, True):
        out = ask(server, stream, extra_body=off)
        assert (out["reasoning"], out["content"]) == (None, "It is sunny.")
    assert engine.prompts[-1] == hf_prompt(Path(engine.checkpoint.path), ASK, enable_thinking=False)
    with pytest.raises(openai.BadRequestError, match="did you mean 'enable_thinking'"):
        ask(server, False, extra_body={"chat_template_kwargs": {"enable_thinkng": False}})
    with pytest.raises(openai.BadRequestError, match="no reasoning-effort switch"):
        ask(server, False, reasoning_effort="low")


def test_a_cut_inside_the_reasoning_has_no_content(qwen3_5: tuple[ThreadServer, ScriptedTextEngine]) -> None:
    server, engine = qwen3_5
    engine.script = "Thinking about the weather in Paris for a long time.\n</think>\n\nSunny."
    for stream in (False, True):
        out = ask(server, stream, max_tokens=5)
        assert out["finish_reason"] == "length" and out["content"] is None and out["reasoning"]


# ------------------------------------------------------------------------------------------------ tool calls
JSON_CALLS = ('<think>\nNeed the weather.\n</think>\n\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": '
              '{"city": "Paris", "days": 2}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
              '</tool_call>')


def test_qwen3_tool_calls_auto(qwen3: tuple[ThreadServer, ScriptedTextEngine]) -> None:
    server, engine = qwen3
    engine.script = JSON_CALLS
    full, streamed = ask(server, False, tools=[WEATHER, TIME]), ask(server, True, tools=[WEATHER, TIME])
    assert same(full, streamed)
    assert [(name, json.loads(args)) for _, name, args in full["tool_calls"]] == [
        ("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]
    assert full["content"] == "Checking." and full["reasoning"] == "Need the weather."
    assert full["finish_reason"] == "tool_calls"
    assert all(call_id.startswith("call_") for call_id, _, _ in full["tool_calls"])
    assert streamed["argument_chunks"] > 3  # the arguments arrive piece by piece
    assert engine.prompts[-1] == hf_prompt(Path(engine.checkpoint.path), ASK, tools=[WEATHER, TIME])


def test_parallel_tool_calls_false_stops_after_the_first(qwen3: tuple[ThreadServer, ScriptedTextEngine]) -> None:
    server, engine = qwen3
    engine.script = JSON_CALLS
    for stream in (False, True):
        out = ask(server, stream, tools=[WEATHER, TIME], parallel_tool_calls=False)
        assert [name for _, name, _ in out["tool_calls"]] == ["get_weather"]
        assert out["finish_reason"] == "tool_calls"


def test_tool_choice_named_and_required_open_the_call(qwen3: tuple[ThreadServer, ScriptedTextEngine]) -> None:
    server, engine = qwen3
    engine.script = '{"city": "Rome"}}\n</tool_call>'  # thinking off: the prompt holds the call's start
    named = {"type": "function", "function": {"name": "get_weather"}}
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    for stream in (False, True):
        out = ask(server, stream, tools=[WEATHER, TIME], tool_choice=named, extra_body=off)
        assert [(name, args) for _, name, args in out["tool_calls"]] == [("get_weather", '{"city": "Rome"}')]
        assert out["content"] is None and out["finish_reason"] == "tool_calls"
    assert engine.tokenizer.decode(engine.prompts[-1], skip_special_tokens=False).endswith(
        '</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": ')
    # thinking on: the model may reason first, then (by the grammar) writes the call from its opening tag
    engine.script = '<think>\nRome.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    out = ask(server, True, tools=[WEATHER, TIME], tool_choice=named)
    assert [(name, args) for _, name, args in out["tool_calls"]] == [("get_weather", '{"city": "Rome"}')]
    assert out["reasoning"] == "Rome." and out["content"] is None
    assert engine.tokenizer.decode(engine.prompts[-1], skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    engine.script = 'get_time", "arguments": {}}\n</tool_call>'
    out = ask(server, True, tools=[WEATHER, TIME], tool_choice="required", extra_body=off)
    assert [(name, args) for _, name, args in out["tool_calls"]] == [("get_time", "{}")]
    with pytest.raises(openai.BadRequestError, match="did you mean 'get_weather'"):
        ask(server, False, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_wether"}})
    with pytest.raises(openai.BadRequestError, match="needs tools"):
        ask(server, False, tool_choice="required")


def test_tool_choice_none_renders_no_tools_and_parses_no_calls(
        qwen3: tuple[ThreadServer, ScriptedTextEngine]) -> None:
    server, engine = qwen3
    engine.script = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    out = ask(server, False, tools=[WEATHER], tool_choice="none")
    assert out["tool_calls"] == [] and out["content"] == engine.script
    assert engine.prompts[-1] == hf_prompt(Path(engine.checkpoint.path), ASK)


def test_tool_results_round_trip_through_the_template(qwen3: tuple[ThreadServer, ScriptedTextEngine],
                                                      qwen3_5: tuple[ThreadServer, ScriptedTextEngine]) -> None:
    for (server, engine), script in ((qwen3, "It is 21 degrees."), (qwen3_5, "Got it.\n</think>\n\nIt is 21 degrees.")):
        engine.script = script
        call = {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}
        history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'}]
        out = ask(server, False, tools=[WEATHER], messages=history)
        assert out["content"] == "It is 21 degrees."
        # transformers' convention (and vLLM's): the template gets the arguments as a mapping
        hf_history = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
            {**call, "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}}]},
            history[2]]
        assert engine.prompts[-1] == hf_prompt(Path(engine.checkpoint.path), hf_history, tools=[WEATHER])
        with pytest.raises(openai.BadRequestError, match="arguments are not JSON"):
            bad = [*ASK, {"role": "assistant", "tool_calls": [{**call, "function": {"name": "f", "arguments": "{"}}]}]
            ask(server, False, messages=bad)


XML_CALL = ("The weather tool.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n"
            "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")


def test_qwen3_5_xml_tool_call(qwen3_5: tuple[ThreadServer, ScriptedTextEngine]) -> None:
    server, engine = qwen3_5
    engine.script = XML_CALL
    full, streamed = ask(server, False, tools=[WEATHER]), ask(server, True, tools=[WEATHER])
    assert same(full, streamed)
    assert [(name, json.loads(args)) for _, name, args in full["tool_calls"]] == [
        ("get_weather", {"city": "New York", "days": 3})]
    assert full["reasoning"] == "The weather tool." and full["content"] is None
    assert engine.prompts[-1] == hf_prompt(Path(engine.checkpoint.path), ASK, tools=[WEATHER])
    # named: the model may reason first (the prompt opened <think>), then the grammar holds it to the call
    engine.script = XML_CALL.replace("city>\nNew York", "city>\nOslo").replace("<parameter=days>\n3\n</parameter>\n", "")
    out = ask(server, True, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert [(name, json.loads(args)) for _, name, args in out["tool_calls"]] == [("get_weather", {"city": "Oslo"})]
    assert out["reasoning"] == "The weather tool."
    assert engine.tokenizer.decode(engine.prompts[-1], skip_special_tokens=False).endswith("<think>\n")
    grammar = json.loads(engine.grammar_specs[-1].text())  # reasoning, then the call from its opening tag
    assert "think[lazy]" in grammar["grammars"][0]["lark_grammar"]
    assert json.dumps("<tool_call>\n<function=get_weather>\n") in grammar["grammars"][0]["lark_grammar"]


def test_tools_need_a_template_with_a_tool_format(live_server: ThreadServer) -> None:
    with pytest.raises(openai.BadRequestError, match="no tool-call format"):
        live_server.client().chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=1, tools=[WEATHER])
    with pytest.raises(openai.BadRequestError, match=r"tools\[0\]"):
        live_server.client().chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=1,
                                                     tools=[{"type": "function", "function": {}}])
