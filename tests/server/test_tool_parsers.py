"""The `<think>` splitter and the tool-call parsers, fed whole and split at every character: the same fields either
way, and no piece of a tag ever shown as content."""

from __future__ import annotations

import json
from typing import Any

import pytest

from moeserve.server.reasoning import ThinkTagSplitter, opens_reasoning
from moeserve.server.tool_parsers import (
    Qwen3JsonToolParser,
    Qwen3XmlToolParser,
    ToolParser,
    json_value_end,
    tool_parser_for,
)
from tests.server.test_chat_tools import QWEN3_5_TEMPLATE, QWEN3_TEMPLATE

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "units": {"type": "object"}, "note": {"type": "string"}}}}}
TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>")


def pieces(text: str, step: int) -> list[str]:
    return [text[i:i + step] for i in range(0, len(text), step)]


def split_every_way(text: str) -> list[list[str]]:
    """The text whole, in pieces of 1, 2, 3 and 7 characters, and cut in two at every position."""
    ways = [[text], *(pieces(text, k) for k in (1, 2, 3, 7))]
    return ways + [[text[:i], text[i:]] for i in range(1, len(text))]


def run_tools(parser: ToolParser, chunks: list[str]) -> tuple[str, dict[int, list[str]], list[str]]:
    """(content, {index: [name, arguments]}, content pieces as streamed)."""
    content, streamed = "", []
    calls: dict[int, list[str]] = {}
    outs = [parser.feed(c) for c in chunks] + [parser.flush()]
    for out in outs:
        content += out.content
        streamed.append(out.content)
        for call in out.calls:
            if call.index not in calls:
                assert call.name is not None, "a call's first delta names it"
                calls[call.index] = [call.name, ""]
            else:
                assert call.name is None, "a call is named once"
            calls[call.index][1] += call.arguments
    return content, calls, streamed


def assert_no_tag_piece(streamed: list[str], final: str, tags: tuple[str, ...] = TAGS) -> None:
    """No streamed content piece ends with the start of a tag, unless the final content really has it there."""
    for piece in streamed:
        for tag in tags:
            for k in range(1, len(tag)):
                if piece.endswith(tag[:k]):
                    assert tag[:k] in final, (piece, tag)


JSON_OUTPUT = ('I will check.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris {x} \\"q\\"", '
               '"days": [1, 2]}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n')


@pytest.mark.parametrize("chunks", split_every_way(JSON_OUTPUT))
def test_qwen3_json_calls_any_split(chunks: list[str]) -> None:
    content, calls, streamed = run_tools(Qwen3JsonToolParser([WEATHER]), chunks)
    assert content == "I will check."
    assert calls == {0: ["get_weather", '{"city": "Paris {x} \\"q\\"", "days": [1, 2]}'], 1: ["get_time", "{}"]}
    assert json.loads(calls[0][1]) == {"city": 'Paris {x} "q"', "days": [1, 2]}
    assert_no_tag_piece(streamed, content)


def test_qwen3_json_arguments_stream_as_they_come() -> None:
    parser = Qwen3JsonToolParser([WEATHER])
    deltas = [parser.feed(c) for c in pieces(JSON_OUTPUT, 1)]
    argument_pieces = [c.arguments for d in deltas for c in d.calls if c.index == 0 and c.arguments]
    assert len(argument_pieces) > 10  # not one lump at the end


def test_qwen3_json_other_key_order_and_string_arguments() -> None:
    text = '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>'
    for chunks in split_every_way(text):
        assert run_tools(Qwen3JsonToolParser([]), chunks)[:2] == ("", {0: ["get_weather", '{"city": "Oslo"}']})
    text = '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n</tool_call>'
    for chunks in split_every_way(text):
        assert run_tools(Qwen3JsonToolParser([]), chunks)[:2] == ("", {0: ["get_weather", '{"city": "Oslo"}']})


def test_a_block_that_is_not_a_call_is_kept_as_content() -> None:
    text = "Use <tool_call>not json</tool_call> like this"
    for chunks in split_every_way(text):
        content, calls, _ = run_tools(Qwen3JsonToolParser([]), chunks)
        assert (content, calls) == (text, {})


def test_text_without_calls_keeps_its_whitespace_and_lone_brackets() -> None:
    text = "a < b and <tool> or <tool_cal\n  "
    for chunks in split_every_way(text):
        assert run_tools(Qwen3JsonToolParser([]), chunks)[:2] == (text, {})


def test_a_call_cut_by_the_end_of_output_keeps_what_arrived() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    for chunks in split_every_way(text):
        content, calls, _ = run_tools(Qwen3JsonToolParser([]), chunks)
        assert (content, calls) == ("", {0: ["get_weather", '{"city": "Pa']})
    # ... and a stop string "</tool_call>" (no parallel calls) leaves a complete call without its closing tag
    content, calls, _ = run_tools(Qwen3JsonToolParser([]), ['<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n'])
    assert calls == {0: ["f", '{"a": 1}']}


XML_OUTPUT = ("Checking.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
              "<parameter=days>\n3\n</parameter>\n<parameter=units>\n{\"t\": \"C\"}\n</parameter>\n"
              "<parameter=note>\nline one\nline < two\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
              "<function=get_time>\n</function>\n</tool_call>")


@pytest.mark.parametrize("chunks", split_every_way(XML_OUTPUT))
def test_qwen3_xml_calls_any_split(chunks: list[str]) -> None:
    content, calls, streamed = run_tools(Qwen3XmlToolParser([WEATHER]), chunks)
    assert content == "Checking."
    assert calls[1] == ["get_time", "{}"]
    assert calls[0][0] == "get_weather"
    assert json.loads(calls[0][1]) == {"city": "San Francisco", "days": 3, "units": {"t": "C"},
                                       "note": "line one\nline < two"}
    assert_no_tag_piece(streamed, content)


def test_qwen3_xml_values_follow_the_schema() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"properties": {
        "code": {"type": "string"}, "n": {"type": "number"}, "flag": {"type": "boolean"}}}}}
    text = ("<tool_call>\n<function=f>\n<parameter=code>\n123\n</parameter>\n<parameter=n>\n2.5\n</parameter>\n"
            "<parameter=flag>\ntrue\n</parameter>\n<parameter=free>\nnot json\n</parameter>\n</function>\n</tool_call>")
    _, calls, _ = run_tools(Qwen3XmlToolParser([tool]), [text])
    assert json.loads(calls[0][1]) == {"code": "123", "n": 2.5, "flag": True, "free": "not json"}


THINK_OUTPUT = "<think>\nStep one.\n\nStep two <b>.\n</think>\n\nThe answer is <thin k."


@pytest.mark.parametrize("chunks", split_every_way(THINK_OUTPUT))
def test_think_split_any_split(chunks: list[str]) -> None:
    splitter = ThinkTagSplitter(starts_in_reasoning=False)
    outs = [splitter.feed(c) for c in chunks] + [splitter.flush()]
    assert "".join(o.reasoning for o in outs) == "Step one.\n\nStep two <b>."
    assert "".join(o.content for o in outs) == "The answer is <thin k."
    assert_no_tag_piece([o.content for o in outs] + [o.reasoning for o in outs], "<b> <thin k")


def test_output_that_starts_inside_the_reasoning() -> None:
    prompt = "<|im_start|>assistant\n<think>\n"
    assert opens_reasoning(prompt) and not opens_reasoning(prompt + "\n</think>\n\n")
    assert not opens_reasoning("<think>old</think> <|im_start|>assistant\n")
    for chunks in split_every_way("Hmm.\n</think>\n\nYes."):
        splitter = ThinkTagSplitter(starts_in_reasoning=True)
        outs = [splitter.feed(c) for c in chunks] + [splitter.flush()]
        assert ("".join(o.reasoning for o in outs), "".join(o.content for o in outs)) == ("Hmm.", "Yes.")


def test_cut_inside_the_reasoning_keeps_it_as_reasoning() -> None:
    splitter = ThinkTagSplitter(starts_in_reasoning=True)
    out = splitter.feed("Thinking about </thi")
    rest = splitter.flush()
    assert (out.reasoning + rest.reasoning, out.content + rest.content) == ("Thinking about </thi", "")


def test_json_value_end_follows_strings() -> None:
    assert json_value_end(' {"a": "}{", "b": [1, {"c": 2}]} tail') == len(' {"a": "}{", "b": [1, {"c": 2}]}')
    assert json_value_end('{"a": "\\"}"') is None


def test_the_template_picks_the_format() -> None:
    assert tool_parser_for(QWEN3_TEMPLATE) is Qwen3JsonToolParser
    assert tool_parser_for(QWEN3_5_TEMPLATE) is Qwen3XmlToolParser
    assert tool_parser_for("{{ messages }}") is None
    assert tool_parser_for(None) is None


def test_forced_prefix_opens_a_call_the_parser_reads() -> None:
    for cls, rest in ((Qwen3JsonToolParser, '{"city": "Rome"}}\n</tool_call>'),
                      (Qwen3XmlToolParser, "<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>")):
        named: Any = cls([WEATHER])
        _, calls, _ = run_tools(named, [cls.forced_prefix("get_weather"), rest])
        assert calls[0][0] == "get_weather" and json.loads(calls[0][1]) == {"city": "Rome"}
