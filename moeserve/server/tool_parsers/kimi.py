"""Kimi-K2 tool calls (tool_parsers/base.py has the interface, tool_parsers/__init__.py the registry).

The format, as Kimi-K2's chat template renders an assistant's calls and as the model writes them:

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}
    <|tool_call_end|><|tool_calls_section_end|>

(no line breaks). The text before `<|tool_call_argument_begin|>` is the call's id, `functions.NAME:IDX`, which the
template writes back verbatim (`tool_call['id']`, and `## Return of {tool_call_id}` for a result): the id the
response gives the call is therefore the model's own, never a `call_...` id the model was not trained on (one that
is not of that form is replaced by `functions.NAME:INDEX`). The name is the id without `functions.` and `:IDX`
(`get_weather:0` alone is read too). The arguments stream as the model writes them (the JSON text).
The template prints an earlier call's arguments as they are when they are a string: they reach it as the JSON text
that was sent.
"""

from __future__ import annotations

import json
import re
from typing import Any

from moeserve.server.tool_parsers.base import JsonArgumentsToolParser, json_call_grammar

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, CALL_END, ARGUMENT_BEGIN = "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"
ID_PREFIX = "functions."
_KIMI_ID = re.compile(r"functions\.([^\s:<]+):\d+")


def call_name(call_id: str) -> str:
    """The function name in a Kimi call id: `functions.get_weather:0` -> `get_weather` (also `get_weather:0`)."""
    name = call_id.removeprefix(ID_PREFIX)
    head, colon, index = name.rpartition(":")
    return head if colon and index.isdigit() else name


class KimiK2ToolParser(JsonArgumentsToolParser):
    name = "kimi_k2"
    call_open, call_close = CALL_BEGIN, CALL_END
    layout_tags = (SECTION_BEGIN, SECTION_END)
    tags = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, CALL_END, ARGUMENT_BEGIN)
    stop_after_call = CALL_END

    @classmethod
    def matches(cls, template: str) -> bool:
        return CALL_BEGIN in template and ARGUMENT_BEGIN in template

    def _head(self, at_close: bool) -> tuple[str, int, str | None] | None:
        sep = self._body.find(ARGUMENT_BEGIN)
        if sep < 0:  # the id is complete only once the separator follows it
            return None
        call_id = self._body[:sep].strip()
        name = call_name(call_id)
        kimi_id = call_id if _KIMI_ID.fullmatch(call_id) else f"{ID_PREFIX}{name}:{self._index}"
        return name, sep + len(ARGUMENT_BEGIN), kimi_id

    @staticmethod
    def forced_prefix(function_name: str | None) -> str:
        # the model writes the call's index (its count of calls in the conversation) itself
        return SECTION_BEGIN + CALL_BEGIN + ID_PREFIX + (f"{function_name}:" if function_name is not None else "")

    @classmethod
    def call_grammar(cls, tools: list[dict[str, Any]], function_name: str | None) -> str | None:
        index = "/[0-9]{1,6}/ " + json.dumps(ARGUMENT_BEGIN)  # after `functions.NAME:`
        return json_call_grammar(tools, function_name, lambda name: f"{name}:", CALL_END + SECTION_END,
                                 between=index)
