"""/v1/chat/completions for a gpt-oss model end to end, with a fake engine that "generates" a scripted harmony
completion: reasoning / content / tool calls in the response, streamed and not, and a cut inside the analysis."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from moeserve.engine.outputs import CompletionOutput, RequestOutput
from moeserve.engine.sampling_params import SamplingParams
from moeserve.server.harmony import load_encoding, vocab_folder
from tests.server.conftest import MODEL_NAME, ThreadServer, make_state

ANSWER = ("<|channel|>analysis<|message|>The user says hi.<|end|><|start|>assistant<|channel|>final<|message|>"
          "Bonjour !<|return|>")
TOOL_CALL = ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
             "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


class ScriptedEngine:
    """Emits the tokens of `script` one per step, then stops (as on <|return|>); honours max_tokens."""

    def __init__(self, script: list[int], folder: Path) -> None:
        self.script = script
        self.checkpoint = SimpleNamespace(config={"model_type": "gpt_oss"}, path=folder)
        self.tokenizer = None
        self.max_model_len = 4096
        self.settings = SimpleNamespace(max_num_seqs=4)
        self.requests: dict[str, tuple[list[int], SamplingParams, list[int]]] = {}
        self.prompts: list[list[int]] = []
        # what the server asks to constrain outputs to (recorded, not applied: the script is the output)
        self.grammar_specs: list[Any] = []
        self.grammar_compiler = SimpleNamespace(compile=lambda spec: self.grammar_specs.append(spec))

    def add_request(self, prompt: Any, params: SamplingParams, request_id: str | None = None) -> str:
        assert request_id is not None
        self.prompts.append(list(prompt))
        self.requests[request_id] = (list(prompt), params, [])
        return request_id

    def abort_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        outputs = []
        for rid, (prompt, params, out) in list(self.requests.items()):
            out.append(self.script[len(out)])
            reason = None
            if len(out) == len(self.script) or out[-1] in (params.stop_token_ids or []):
                reason = "stop"
            elif len(out) >= (params.max_tokens or 1):
                reason = "length"
            comps = [CompletionOutput(i, "", list(out), None, None, reason) for i in range(params.n)]
            outputs.append(RequestOutput(rid, None, prompt, comps, reason is not None))
            if reason is not None:
                del self.requests[rid]
        return outputs


@pytest.fixture(scope="module")
def encoding() -> Any:
    return load_encoding(str(vocab_folder(None)))


def serve(thread_server: Any, encoding: Any, tmp_path: Path, completion: str) -> tuple[ThreadServer, Any]:
    engine = ScriptedEngine(list(encoding.encode(completion, allowed_special="all")), tmp_path)
    return thread_server(make_state(lambda: engine)), engine


def test_reasoning_and_content_are_split(thread_server: Any, encoding: Any, tmp_path: Path) -> None:
    server, engine = serve(thread_server, encoding, tmp_path, ANSWER)
    client = server.client()
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=100)
    message = out.model_dump()["choices"][0]["message"]
    assert message["content"] == "Bonjour !"
    assert message["reasoning"] == message["reasoning_content"] == "The user says hi."
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.prompt_tokens == len(engine.prompts[0])
    assert engine.prompts[0][-2:] == encoding.encode("<|start|>assistant", allowed_special="all")

    reasoning = content = ""
    finishes = []
    for chunk in client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=100, stream=True):
        delta = chunk.model_dump()["choices"][0]["delta"]
        reasoning += delta.get("reasoning") or ""
        content += delta.get("content") or ""
        finishes.append(chunk.choices[0].finish_reason)
    assert (reasoning, content) == ("The user says hi.", "Bonjour !")
    assert [f for f in finishes if f] == ["stop"]


def test_max_tokens_inside_the_analysis(thread_server: Any, encoding: Any, tmp_path: Path) -> None:
    server, _ = serve(thread_server, encoding, tmp_path, ANSWER)
    out = server.client().chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5)
    message = out.model_dump()["choices"][0]["message"]
    assert out.choices[0].finish_reason == "length"
    assert message["content"] is None  # no final answer was produced
    assert message["reasoning"] and "The user says hi.".startswith(message["reasoning"])


def test_tool_call(thread_server: Any, encoding: Any, tmp_path: Path) -> None:
    server, _ = serve(thread_server, encoding, tmp_path, TOOL_CALL)
    out = server.client().chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=100)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("get_weather", "{\"city\": \"Paris\"}")]
    assert choice.message.model_dump()["reasoning"] == "Need weather."


def test_output_without_harmony_structure_is_content(thread_server: Any, encoding: Any, tmp_path: Path) -> None:
    server, _ = serve(thread_server, encoding, tmp_path, "Just an answer without channels.<|return|>")
    out = server.client().chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=100)
    assert out.choices[0].message.content == "Just an answer without channels."
    streamed = "".join(c.choices[0].delta.content or "" for c in server.client().chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=100, stream=True))
    assert streamed == "Just an answer without channels."


def test_named_tool_choice_puts_the_call_header_in_the_prompt(thread_server: Any, encoding: Any,
                                                              tmp_path: Path) -> None:
    server, engine = serve(thread_server, encoding, tmp_path, "{\"city\": \"Rome\"}<|call|>")
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    named = {"type": "function", "function": {"name": "get_weather"}}
    for stream in (False, True):
        kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=100, tools=[tool], tool_choice=named)
        if stream:
            calls: dict[int, list[str]] = {}
            for chunk in server.client().chat.completions.create(stream=True, **kwargs):
                for call in chunk.choices[0].delta.tool_calls or []:
                    entry = calls.setdefault(call.index, ["", ""])
                    entry[0] += call.function.name or ""
                    entry[1] += call.function.arguments or ""
            got = [tuple(calls[i]) for i in sorted(calls)]
        else:
            message = server.client().chat.completions.create(**kwargs).choices[0].message
            got = [(c.function.name, c.function.arguments) for c in message.tool_calls]
        assert got == [("get_weather", "{\"city\": \"Rome\"}")]
    header = encoding.encode("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
                             "<|message|>", allowed_special="all")
    assert engine.prompts[-1][-len(header):] == header
    spec = engine.grammar_specs[-1]  # the arguments are constrained to the tool's parameters schema
    assert (spec.kind, spec.param) == ("lark", "tools") and '%json {"type": "object"' in spec.value


def test_response_format_opens_the_final_channel(thread_server: Any, encoding: Any, tmp_path: Path) -> None:
    server, engine = serve(thread_server, encoding, tmp_path, "{\"a\": 1}<|return|>")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    message = server.client().chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=100,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}).choices[0].message
    assert message.content == "{\"a\": 1}" and message.reasoning_content is None  # type: ignore[attr-defined]
    header = encoding.encode("<|start|>assistant<|channel|>final<|message|>", allowed_special="all")
    assert engine.prompts[-1][-len(header):] == header
    assert engine.grammar_specs[-1].value["properties"] == schema["properties"]
