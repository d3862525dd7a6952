"""DeepSeek-V3 / DeepSeek-R1 tool calls (tool_parsers/base.py has the interface, tool_parsers/__init__.py the registry).

The format, as DeepSeek's chat template renders an assistant's calls (each tag one token of its tokenizer):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time ...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

DeepSeek-V3.1's shorter form, `<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>`, is
read too. The arguments stream as the model writes them (the JSON text between the braces). The template
concatenates an earlier call's arguments as text, so they reach it as the JSON string that was sent.
"""

from __future__ import annotations

from typing import Any

from moeserve.server.tool_parsers.base import JsonArgumentsToolParser, json_call_grammar

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, TOOL_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE_OPEN, FENCE_CLOSE = "```json\n", "\n```"


class DeepSeekV3ToolParser(JsonArgumentsToolParser):
    name = "deepseek_v3"
    call_open, call_close = CALL_BEGIN, CALL_END
    layout_tags = (CALLS_BEGIN, CALLS_END)
    tags = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, TOOL_SEP)
    stop_after_call = CALL_END

    def _head(self, at_close: bool) -> tuple[str, int, str | None] | None:
        sep = self._body.find(TOOL_SEP)
        if sep < 0:
            return None
        before, after = self._body[:sep].strip(), sep + len(TOOL_SEP)
        if before and before != "function":  # V3.1: the name before the separator
            return before, after, None
        end = self._body.find("\n", after)  # V3: the type before it, the name on the rest of the line
        if end < 0:
            return (self._body[after:].strip(), len(self._body), None) if at_close else None
        start = end + 1
        if self._body.startswith(FENCE_OPEN, start):
            start += len(FENCE_OPEN)
        elif FENCE_OPEN.startswith(self._body[start:]) and not at_close:
            return None  # the fence may still be coming
        return self._body[after:end].strip(), start, None

    @staticmethod
    def _raw_arguments(text: str) -> str:
        return text.strip().removesuffix("```").strip()  # the fence removed

    @classmethod
    def matches(cls, template: str) -> bool:
        return CALL_BEGIN in template and TOOL_SEP in template

    @staticmethod
    def forced_prefix(function_name: str | None) -> str:
        head = CALLS_BEGIN + CALL_BEGIN + "function" + TOOL_SEP
        return head + (f"{function_name}\n{FENCE_OPEN}" if function_name is not None else "")

    @classmethod
    def call_grammar(cls, tools: list[dict[str, Any]], function_name: str | None) -> str | None:
        return json_call_grammar(tools, function_name, lambda name: f"{name}\n{FENCE_OPEN}",
                                 FENCE_CLOSE + CALL_END + CALLS_END)
