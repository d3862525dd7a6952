"""The tool-call formats, one parser class per format behind `ToolParser` (tool_parser_base.py), picked from the
chat template by `tool_parser_for` (callers never branch on the format)."""

from __future__ import annotations

from moeserve.server.tool_parsers.base import (
    Qwen3JsonToolParser,
    ToolCallDelta,
    ToolParse,
    ToolParser,
    json_value_end,
    parameters_schema,
)
from moeserve.server.tool_parsers.deepseek import DeepSeekV3ToolParser
from moeserve.server.tool_parsers.gemma4 import Gemma4ToolParser
from moeserve.server.tool_parsers.kimi import KimiK2ToolParser
from moeserve.server.tool_parsers.xml import Glm45ToolParser, Qwen3XmlToolParser

# Most specific first: the XML-format and GLM templates also mention <tool_call>.
TOOL_PARSERS: list[type[ToolParser]] = [Qwen3XmlToolParser, Glm45ToolParser, DeepSeekV3ToolParser, KimiK2ToolParser,
                                        Gemma4ToolParser, Qwen3JsonToolParser]
__all__ = ["TOOL_PARSERS", "DeepSeekV3ToolParser", "Gemma4ToolParser", "Glm45ToolParser", "KimiK2ToolParser",
           "Qwen3JsonToolParser",
           "Qwen3XmlToolParser", "ToolCallDelta", "ToolParse", "ToolParser", "json_value_end", "parameters_schema",
           "tool_parser_for"]


def tool_parser_for(template: str | None) -> type[ToolParser] | None:
    """The tool-call format a chat template renders, or None when it has none."""
    for parser in TOOL_PARSERS:
        if template and parser.matches(template):
            return parser
    return None
