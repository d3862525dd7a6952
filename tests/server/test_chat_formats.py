"""GLM-4.5 and DeepSeek-V3/R1 chat formats end to end with the official `openai` client (streamed and not).

Templates (tests/server/templates): `glm4_5.jinja` is GLM-4.5/4.6's published template; `deepseek_r1.jinja` is
DeepSeek-R1's (it shows no tools to the model), `deepseek_r1_tools.jinja` the same with a tools section added here,
`deepseek_v3_tools.jinja` that one with DeepSeek-V3's generation prompt (no `<think>`).

Two engines: a scripted one that "generates" a given text (auto calls, parallel calls, reasoning: a random model
would not write them), whose received prompts are compared with transformers' apply_chat_template; and a real
engine on a tiny random model, where forced calls (required / named) and json_schema answers are the grammar's work
alone, each validated with jsonschema (also on the Qwen3 and Qwen3.5 templates: JSON and XML calls).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from moeserve.bench.checkpoints import write_tiny_checkpoint
from tests.server.conftest import MODEL_NAME, ThreadServer, engine_factory, make_state
from tests.server.test_chat_tools import (
    ASK,
    TIME,
    WEATHER,
    ScriptedTextEngine,
    _model_folder,
    _serve,
    ask,
    hf_prompt,
    same,
)
from tests.server.test_structured_output import SCHEMAS, _format
from tests.server.test_tool_formats import SCHEMAS as TOOL_SCHEMAS
from tests.server.test_tool_formats import TOOLS

TEMPLATES = Path(__file__).parent / "templates"
Served = tuple[ThreadServer, ScriptedTextEngine]
BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


@pytest.fixture(scope="module")
def glm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from _serve(tmp_path_factory, (TEMPLATES / "glm4_5.jinja").read_text())


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from _serve(tmp_path_factory, (TEMPLATES / "deepseek_r1_tools.jinja").read_text())


def calls_of(out: dict[str, Any]) -> list[tuple[str, Any]]:
    return [(name, json.loads(args)) for _, name, args in out["tool_calls"]]


GLM_CALLS = ("\n<think>Two tools.</think>\nChecking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
             "<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>\n"
             "<tool_call>get_time\n</tool_call>")
DEEPSEEK_CALLS = (f"I need the weather.\n</think>\n\nChecking.{BEGIN}{CALL}function{SEP}get_weather\n```json\n"
                  f'{{"city": "Paris", "days": 2}}\n```{CALL_END}\n{CALL}function{SEP}get_time\n```json\n{{}}\n```'
                  f"{CALL_END}{END}")


@pytest.mark.parametrize("fmt", ["glm", "deepseek"])
def test_reasoning_and_parallel_calls(fmt: str, request: pytest.FixtureRequest) -> None:
    server, engine = request.getfixturevalue(fmt)
    engine.script = GLM_CALLS if fmt == "glm" else DEEPSEEK_CALLS
    full = ask(server, False, tools=[WEATHER, TIME], max_tokens=1000)
    streamed = ask(server, True, tools=[WEATHER, TIME], max_tokens=1000)
    assert same(full, streamed) and streamed["argument_chunks"] >= 1
    assert calls_of(full) == [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]
    assert full["reasoning"] == ("Two tools." if fmt == "glm" else "I need the weather.")
    assert full["content"] == "Checking." and full["finish_reason"] == "tool_calls"
    assert engine.prompts[-1] == hf_prompt(Path(engine.checkpoint.path), ASK, tools=[WEATHER, TIME])
    one = ask(server, True, tools=[WEATHER, TIME], parallel_tool_calls=False, max_tokens=1000)
    assert calls_of(one) == [("get_weather", {"city": "Paris", "days": 2})]


def hf_render_keeping_null(folder: Path, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    """transformers' own compiled template and tokenizer, without its step that drops null keys (with DeepSeek's
    template a tool-call message whose content key is gone fails; null content is what it tests for)."""
    from transformers import AutoTokenizer
    from transformers.utils.chat_template_utils import _compile_jinja_template

    tok = AutoTokenizer.from_pretrained(str(folder))
    text = _compile_jinja_template(tok.chat_template).render(messages=messages, add_generation_prompt=True,
                                                             **tok.special_tokens_map, **kwargs)
    return list(tok.encode(text, add_special_tokens=False))


def test_tool_results_round_trip(glm: Served, deepseek: Served) -> None:
    """A call and its result rendered back: the prompt's ids equal transformers' on the same conversation, given
    as each template expects it (GLM reads the arguments as a mapping, DeepSeek concatenates the JSON text and
    tests the content for null)."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'}]
    for (server, engine), as_mapping in ((glm, True), (deepseek, False)):
        engine.script = "It is 21 degrees."
        out = ask(server, False, tools=[WEATHER], messages=history)
        assert out["content"] == "It is 21 degrees."
        folder = Path(engine.checkpoint.path)
        if as_mapping:  # transformers' convention for templates that read a mapping; content "" (not "None")
            hf_history = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
                {**call, "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}}]},
                history[2]]
            assert engine.prompts[-1] == hf_prompt(folder, hf_history, tools=[WEATHER])
        else:
            assert engine.prompts[-1] == hf_render_keeping_null(folder, history, tools=[WEATHER])
            assert "<｜Assistant｜><｜end▁of▁sentence｜>" not in engine.tokenizer.decode(engine.prompts[-1])


def test_forced_calls_with_thinking_on_are_constrained_after_the_reasoning(glm: Served, deepseek: Served) -> None:
    for (server, engine), prompt_end in ((glm, "<|assistant|>"), (deepseek, "<｜Assistant｜><think>\n")):
        engine.script = GLM_CALLS if server is glm[0] else DEEPSEEK_CALLS
        named = {"type": "function", "function": {"name": "get_weather"}}
        out = ask(server, True, tools=[WEATHER, TIME], tool_choice=named, max_tokens=1000)
        assert calls_of(out)[0] == ("get_weather", {"city": "Paris", "days": 2}) and out["reasoning"]
        assert engine.tokenizer.decode(engine.prompts[-1], skip_special_tokens=False).endswith(prompt_end)
        grammar = json.loads(engine.grammar_specs[-1].text())["grammars"][0]["lark_grammar"]
        assert "think[lazy]" in grammar


def test_a_template_that_shows_no_tools_refuses_them(tmp_path: Path) -> None:
    engine = ScriptedTextEngine(_model_folder(tmp_path / "m", (TEMPLATES / "deepseek_r1.jinja").read_text()))
    server = ThreadServer(make_state(lambda: engine))
    try:
        with pytest.raises(openai.BadRequestError, match="does not show tools to the model"):
            ask(server, False, tools=[WEATHER])
        engine.script = "Hmm.\n</think>\n\nHello."
        out = ask(server, False)
        assert out["reasoning"] == "Hmm." and out["content"] == "Hello."
        assert engine.prompts[-1] == hf_prompt(Path(engine.checkpoint.path), ASK)
    finally:
        server.stop()


def test_tags_that_are_special_tokens_are_kept_in_the_text(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """With a tokenizer whose tool-call and <think> tags are special tokens (skip_special_tokens would drop them),
    chat outputs are decoded keeping them, and the choice is logged."""
    from tokenizers import AddedToken, Tokenizer

    folder = _model_folder(tmp_path / "m", (TEMPLATES / "glm4_5.jinja").read_text())
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tags = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
            "</arg_value>"]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tags])
    tok.save(str(folder / "tokenizer.json"))
    engine = ScriptedTextEngine(folder)
    engine.script = GLM_CALLS
    server = ThreadServer(make_state(lambda: engine))
    try:
        with caplog.at_level("INFO", logger="moeserve"):  # the chat format is set up on the first chat request
            for stream in (False, True):
                out = ask(server, stream, tools=[WEATHER, TIME], max_tokens=1000)
                assert calls_of(out) == [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]
                assert out["reasoning"] == "Two tools." and out["content"] == "Checking."
        assert "are special tokens of this tokenizer" in caplog.text
    finally:
        server.stop()


# --------------------------------------------------------------------------------- real engine, random model
def _real_server(folder: Path, template: str) -> ThreadServer:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(_model_folder(folder, template) / "tokenizer.json"))
    write_tiny_checkpoint(folder, "qwen3_moe", vocab_size=tok.get_vocab_size(),
                          eos_token_id=tok.token_to_id("<|im_end|>"), max_position_embeddings=4096)
    return ThreadServer(make_state(engine_factory(folder, max_num_seqs=8)))


@pytest.fixture(scope="module", params=["glm4_5", "deepseek_v3_tools", "qwen3", "qwen3_5"])
def real(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any]]:
    server = _real_server(tmp_path_factory.mktemp(request.param), (TEMPLATES / f"{request.param}.jinja").read_text())
    # thinking switched off where the template has the switch (a random model would not close its <think>);
    # DeepSeek-V3's prompt opens none
    extra = {} if request.param == "deepseek_v3_tools" else {"chat_template_kwargs": {"enable_thinking": False}}
    yield extra, server
    server.stop()


def test_forced_calls_follow_the_schema_on_a_random_model(real: tuple[dict[str, Any], ThreadServer]) -> None:
    extra, server = real
    choices: list[Any] = ["required", {"type": "function", "function": {"name": "get_weather"}},
                          {"type": "function", "function": {"name": "get_time"}}]
    for tool_choice in choices:
        for seed, stream in ((0, False), (1, True), (2, False)):
            out = ask(server, stream, tools=TOOLS, tool_choice=tool_choice, temperature=1.0, seed=seed,
                      max_tokens=400, extra_body=extra)
            assert out["finish_reason"] == "tool_calls" and len(out["tool_calls"]) == 1, out
            name, arguments = calls_of(out)[0]
            assert isinstance(tool_choice, str) or name == tool_choice["function"]["name"]
            jsonschema.validate(arguments, TOOL_SCHEMAS[name])


def test_json_schema_twenty_samples_at_temperature_1(real: tuple[dict[str, Any], ThreadServer]) -> None:
    extra, server = real
    client = server.client()
    schema = SCHEMAS[0]
    for seed in range(20):
        resp = client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=150,  # type: ignore
                                              temperature=1.0, seed=seed, response_format=_format(schema),
                                              stream=seed % 2 == 1, extra_body=extra)
        if seed % 2:
            text = "".join(c.choices[0].delta.content or "" for c in resp if c.choices)  # type: ignore[union-attr]
        else:
            text = resp.choices[0].message.content or ""  # type: ignore[union-attr]
        jsonschema.validate(json.loads(text), schema)
