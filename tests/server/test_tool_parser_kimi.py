"""The Kimi-K2 tool-call parser: fed whole and split at every character (the same fields either way, no piece of a
tag ever shown as content), the call ids the model writes kept as the calls' ids (Kimi's template writes them back),
a forced call's opening read back, the published template picking the format; and through the server (a scripted
engine behind the published Kimi-K2-Thinking template): calls and their ids in responses and streams, the history
sent back rendered as transformers renders it, a named call constrained from its opening tags."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from moeserve.server.chat import _Choice
from moeserve.server.tool_parsers import KimiK2ToolParser, ToolParser, tool_parser_for
from moeserve.server.tool_parsers.base import ToolCallDelta
from moeserve.server.tool_parsers.kimi import (
    ARGUMENT_BEGIN,
    CALL_BEGIN,
    CALL_END,
    SECTION_BEGIN,
    SECTION_END,
    call_name,
)
from tests.server.conftest import ThreadServer
from tests.server.test_chat_tools import ASK, TIME, ScriptedTextEngine, _serve, ask, hf_prompt, same
from tests.server.test_tool_parsers import WEATHER, assert_no_tag_piece, run_tools, split_every_way

PUBLISHED = Path(__file__).parent / "templates" / "published"
KIMI_TAGS = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, CALL_END, ARGUMENT_BEGIN)

KIMI_OUTPUT = (f'Let me check. {SECTION_BEGIN}{CALL_BEGIN}functions.get_weather:3{ARGUMENT_BEGIN}{{"city": "Paris '
               f'{{x}} <|\\"", "days": [1, 2]}}{CALL_END}{CALL_BEGIN} functions.get_time:4 {ARGUMENT_BEGIN}{{}}'
               f'{CALL_END}{SECTION_END}')


def call_ids(parser: ToolParser, chunks: list[str]) -> dict[int, str | None]:
    ids: dict[int, str | None] = {}
    for out in [parser.feed(c) for c in chunks] + [parser.flush()]:
        for call in out.calls:
            if call.name is not None:
                ids[call.index] = call.call_id
    return ids


@pytest.mark.parametrize("chunks", split_every_way(KIMI_OUTPUT))
def test_kimi_calls_any_split(chunks: list[str]) -> None:
    content, calls, streamed = run_tools(KimiK2ToolParser([WEATHER]), chunks)
    assert content == "Let me check."
    assert calls == {0: ["get_weather", '{"city": "Paris {x} <|\\"", "days": [1, 2]}'], 1: ["get_time", "{}"]}
    assert_no_tag_piece(streamed, content, KIMI_TAGS)
    assert call_ids(KimiK2ToolParser([WEATHER]), chunks) == {0: "functions.get_weather:3", 1: "functions.get_time:4"}


def test_arguments_stream_as_they_come() -> None:
    parser = KimiK2ToolParser([WEATHER])
    first = parser.feed(f'{SECTION_BEGIN}{CALL_BEGIN}functions.get_weather:0{ARGUMENT_BEGIN}{{"city": "Pa')
    assert [(c.name, c.call_id) for c in first.calls if c.name] == [("get_weather", "functions.get_weather:0")]
    assert "".join(c.arguments for c in first.calls) == '{"city": "Pa'  # sent before the call ends
    assert [c.arguments for c in parser.feed('ris"}').calls] == ['ris"}']


def test_ids_not_of_kimi_form_are_replaced() -> None:
    """`get_weather:0` (vLLM reads it too) or a bare name: the name is read, the id becomes functions.NAME:INDEX (an
    id of another form in the history confuses the model)."""
    text = (f"{SECTION_BEGIN}{CALL_BEGIN}get_weather:7{ARGUMENT_BEGIN}{{}}{CALL_END}{CALL_BEGIN}get_time"
            f"{ARGUMENT_BEGIN}{{}}{CALL_END}{SECTION_END}")
    _, calls, _ = run_tools(KimiK2ToolParser([WEATHER]), [text])
    assert calls == {0: ["get_weather", "{}"], 1: ["get_time", "{}"]}
    assert call_ids(KimiK2ToolParser([WEATHER]), [text]) == {0: "functions.get_weather:0", 1: "functions.get_time:1"}
    assert [call_name(i) for i in ("functions.a_b-c:12", "a:1", "functions.x", "f:y")] == ["a_b-c", "a", "x", "f:y"]


def test_cut_calls_and_non_calls() -> None:
    """A call cut by the end of the output keeps what arrived; a block without the argument separator is content,
    tags and all; a text without calls keeps its trailing whitespace."""
    content, calls, _ = run_tools(KimiK2ToolParser([WEATHER]),
                                  [f'{SECTION_BEGIN}{CALL_BEGIN}functions.get_weather:0{ARGUMENT_BEGIN}{{"city": "R'])
    assert content == "" and calls == {0: ["get_weather", '{"city": "R']}
    content, calls, _ = run_tools(KimiK2ToolParser([WEATHER]), [f"a {CALL_BEGIN}functions.f:0{CALL_END} b"])
    assert calls == {} and content == f"a {CALL_BEGIN}functions.f:0{CALL_END} b"
    content, calls, _ = run_tools(KimiK2ToolParser([WEATHER]), ["Plain text, no calls.  "])
    assert content == "Plain text, no calls.  " and calls == {}


@pytest.mark.parametrize("named", [None, "get_weather"])
def test_forced_prefix_opens_a_call_the_parser_reads(named: str | None) -> None:
    rest = ("" if named else "get_weather:") + f'2{ARGUMENT_BEGIN}{{"city": "Rome"}}{CALL_END}{SECTION_END}'
    parser = KimiK2ToolParser([WEATHER])
    content, calls, _ = run_tools(parser, [KimiK2ToolParser.forced_prefix(named), rest])
    assert content == "" and calls[0][0] == "get_weather" and json.loads(calls[0][1]) == {"city": "Rome"}


def test_the_published_template_picks_kimi_and_the_response_keeps_its_ids() -> None:
    assert tool_parser_for((PUBLISHED / "moonshotai-Kimi-K2-Thinking.jinja").read_text()) is KimiK2ToolParser
    choice = _Choice(parser=None, parallel=True)  # type: ignore[arg-type]  # only the id bookkeeping is used
    deltas = choice.tool_call_deltas([ToolCallDelta(0, "get_time", "{}", "functions.get_time:5"),
                                      ToolCallDelta(1, "get_time", "{}")])
    assert deltas[0]["id"] == "functions.get_time:5"  # the format's own id
    assert deltas[1]["id"].startswith("call_")  # a format without ids: the server's


# ------------------------------------------------------------------------------------------- through the server
@pytest.fixture(scope="module")
def kimi(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ThreadServer, ScriptedTextEngine]]:
    yield from _serve(tmp_path_factory, (PUBLISHED / "moonshotai-Kimi-K2-Thinking.jinja").read_text())


KIMI_CALLS = (f"<think>Need the weather.</think>Checking.{SECTION_BEGIN}{CALL_BEGIN}functions.get_weather:0"
              f'{ARGUMENT_BEGIN}{{"city": "Paris", "days": 2}}{CALL_END}{CALL_BEGIN}functions.get_time:1'
              f"{ARGUMENT_BEGIN}{{}}{CALL_END}{SECTION_END}")


def test_kimi_calls_and_ids_through_the_server(kimi: tuple[ThreadServer, ScriptedTextEngine]) -> None:
    server, engine = kimi
    engine.script = KIMI_CALLS
    full, streamed = (ask(server, stream, tools=[WEATHER, TIME], max_tokens=1000) for stream in (False, True))
    assert same(full, streamed)
    for out in (full, streamed):
        assert out["tool_calls"] == [("functions.get_weather:0", "get_weather", '{"city": "Paris", "days": 2}'),
                                     ("functions.get_time:1", "get_time", "{}")]
        assert (out["reasoning"], out["content"], out["finish_reason"]) == ("Need the weather.", "Checking.",
                                                                            "tool_calls")
    # the client sends the calls back as the model card does (the response's message, then each result by id):
    # the prompt is transformers' rendering, holding the model's own ids and arguments text
    calls = [{"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in full["tool_calls"]]
    history = [*ASK, {"role": "assistant", "content": "Checking.", "tool_calls": calls},
               {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": '{"sky": "sunny"}'},
               {"role": "tool", "tool_call_id": "functions.get_time:1", "content": "14:05"}]
    engine.script = "Sunny."
    assert ask(server, False, tools=[WEATHER, TIME], messages=history)["content"] == "Sunny."
    assert engine.prompts[-1] == hf_prompt(Path(engine.checkpoint.path), history, tools=[WEATHER, TIME])
    text = engine.tokenizer.decode(engine.prompts[-1], skip_special_tokens=False)
    assert f'{CALL_BEGIN}functions.get_weather:0{ARGUMENT_BEGIN}{{"city": "Paris", "days": 2}}{CALL_END}' in text
    assert "## Return of functions.get_time:1\n14:05" in text


def test_kimi_named_call_is_constrained_from_its_opening(kimi: tuple[ThreadServer, ScriptedTextEngine]) -> None:
    """The template has <think> tags: the model may reason first, then the grammar holds it to the call, from the
    section's opening tags and the function's id prefix on; the model writes the call's index."""
    server, engine = kimi
    engine.script = (f"<think>Rome.</think>{SECTION_BEGIN}{CALL_BEGIN}functions.get_weather:3{ARGUMENT_BEGIN}"
                     f'{{"city": "Rome"}}{CALL_END}{SECTION_END}')
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = ask(server, True, tools=[WEATHER, TIME], tool_choice=named, max_tokens=1000)
    assert out["tool_calls"] == [("functions.get_weather:3", "get_weather", '{"city": "Rome"}')]
    assert out["reasoning"] == "Rome." and out["content"] is None
    grammar = json.loads(engine.grammar_specs[-1].text())["grammars"][0]["lark_grammar"]
    assert "think[lazy]" in grammar and json.dumps(KimiK2ToolParser.forced_prefix("get_weather")) in grammar
