"""Gemma-4 tool calls (tool_parsers/base.py has the interface, tool_parsers/__init__.py the registry).

The format, as Gemma-4's published chat template renders an assistant's calls (its `format_argument` macro) and as
the model writes them:

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2}<tool_call|><|tool_call>call:get_time{}<tool_call|>

Not JSON: keys are bare words (a nested mapping's too), strings are quoted by the `<|"|>` token and hold any text,
numbers and `true` / `false` are written as they are, lists in `[...]`. The name is sent once `call:NAME{` has
arrived; the arguments, turned into JSON, when the call closes (a value may hold any text up to its closing quote).
A block that does not parse as such a call is content, never lost. Calls are not constrained by a grammar
(`call_grammar` is None): with tool_choice required or named, the call's opening is put in the prompt.
"""

from __future__ import annotations

import json
import re
from typing import Any

from moeserve.server.tool_parsers.base import TaggedToolParser, ToolParse

CALL_OPEN, CALL_CLOSE, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
_HEAD = re.compile(r"\s*call:([^{\s]+)\{")
_SCALAR_END = re.compile(r"[,}\]]")


class _Unparsed(ValueError):
    """The text is not a value of the format."""


def parse_value(text: str, at: int) -> tuple[Any, int]:
    """The value starting at `text[at]` and where it ends (_Unparsed when it is not one)."""
    if text.startswith(QUOTE, at):
        end = text.find(QUOTE, at + len(QUOTE))
        if end < 0:
            raise _Unparsed("an unclosed string")
        return text[at + len(QUOTE):end], end + len(QUOTE)
    if text.startswith("{", at):
        return _parse_items(text, at + 1, "}", keyed=True)
    if text.startswith("[", at):
        return _parse_items(text, at + 1, "]", keyed=False)
    found = _SCALAR_END.search(text, at)
    end = found.start() if found else len(text)
    word = text[at:end].strip()
    if not word:
        raise _Unparsed("an empty value")
    try:
        return json.loads(word), end  # numbers, true, false, null
    except ValueError:
        return word, end  # a bare word the model wrote: kept as text


def _parse_items(text: str, at: int, close: str, keyed: bool) -> tuple[Any, int]:
    """A mapping (`keyed`: `key:value` items) or a list, its opening already read, up to `close`."""
    items: list[Any] = []
    pairs: dict[str, Any] = {}
    while True:
        if text.startswith(close, at):
            return (pairs if keyed else items), at + 1
        if keyed:
            if text.startswith(QUOTE, at):
                key, at = parse_value(text, at)
            else:
                colon = text.find(":", at)
                if colon < 0:
                    raise _Unparsed("a key without a value")
                key, at = text[at:colon].strip(), colon
            if not text.startswith(":", at):
                raise _Unparsed("a key without ':'")
            pairs[key], at = parse_value(text, at + 1)
        else:
            value, at = parse_value(text, at)
            items.append(value)
        if text.startswith(",", at):
            at += 1
        elif not text.startswith(close, at):
            raise _Unparsed(f"no ',' or '{close}' after an item")


class Gemma4ToolParser(TaggedToolParser):
    name = "gemma4"
    call_open, call_close = CALL_OPEN, CALL_CLOSE
    tags = (CALL_OPEN, CALL_CLOSE, QUOTE)
    stop_after_call = CALL_CLOSE

    @classmethod
    def matches(cls, template: str) -> bool:
        return CALL_OPEN + "call:" in template

    def _advance(self, out: ToolParse) -> None:
        if not self._name_sent and (head := _HEAD.match(self._body)) is not None:
            self._call(out, name=head.group(1))

    def _close(self, out: ToolParse, complete: bool) -> None:
        head = _HEAD.match(self._body)
        try:
            if head is None:
                raise _Unparsed("no call:NAME{")
            arguments, end = parse_value(self._body, head.end() - 1)
            if self._body[end:].strip():
                raise _Unparsed("text after the arguments")
        except _Unparsed:
            if not self._name_sent:  # not a call: its text is content
                self._as_content(out, complete)
                return
            arguments = {}  # a call cut short or garbled after its name: no arguments can be read
        self._advance(out)
        self._call(out, arguments=json.dumps(arguments, ensure_ascii=False))

    @staticmethod
    def forced_prefix(function_name: str | None) -> str:
        return CALL_OPEN + "call:" + (function_name + "{" if function_name is not None else "")
