"""Tool-call formats that write each argument as a key and a raw value between tags (tool_parsers/__init__.py has the
interface and the registry):

- `qwen3_xml` (Qwen3-Coder, Qwen3.5): `<tool_call>\\n<function=f>\\n<parameter=x>\\nvalue\\n</parameter>\\n
  </function>\\n</tool_call>`;
- `glm45` (GLM-4.5, GLM-4.6): `<tool_call>f\\n<arg_key>x</arg_key>\\n<arg_value>value</arg_value>\\n</tool_call>`.

Each parameter is added to the arguments JSON once its closing tag arrives, its value typed by the tool's JSON schema
(string unless the schema says otherwise: the templates write strings raw and other values as JSON).

With tool_choice required or a named function the call is constrained (`call_grammar`): the parameters in the
schema's order, each required one present, string values free text up to the closing tag (an enum: one of its
strings), other values JSON of the parameter's schema.
"""

from __future__ import annotations

import json
import re
from typing import Any

from moeserve.server.tool_parsers.base import CALL_OPEN, TaggedToolParser, ToolParse, parameters_schema


def typed_value(text: str, schema: dict[str, Any] | None) -> Any:
    """A parameter's text as the JSON value its schema asks for; a string when the schema says so, or when the
    text is not valid for the type."""
    kind = (schema or {}).get("type")
    if kind == "string" or (isinstance(kind, list) and "string" in kind):
        return text
    if kind is None and not text.strip():
        return text
    try:
        return json.loads(text.strip())
    except ValueError:
        return text


class KeyValueToolParser(TaggedToolParser):
    """A call's body is a function name (`_head`, which must be ended by what follows it, or by the block's end:
    `_head_at_close`) then parameters (`_param`: key and raw value); `_value` strips the template's layout."""

    _head: re.Pattern[str]
    _head_at_close: re.Pattern[str]
    _param: re.Pattern[str]
    # for the grammar: what follows the forced prefix when the model names the function, and each parameter's tags
    _name_tail: str
    _param_open: str  # with {key}
    _value_close: str
    _call_tail: str

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        super().__init__(tools)
        self._pos = 0  # how far into the body has been parsed
        self._params_sent = 0
        self._function = ""

    @staticmethod
    def _value(raw: str) -> str:
        return raw

    def _advance(self, out: ToolParse, at_close: bool = False) -> None:
        if not self._name_sent:
            head = (self._head_at_close if at_close else self._head).match(self._body)
            if head is None:
                return
            self._function = head.group(1).strip()
            self._call(out, name=self._function)
            self._pos, self._params_sent = head.end(), 0
        properties = ((self.tools.get(self._function) or {}).get("parameters") or {}).get("properties") or {}
        while (param := self._param.match(self._body, self._pos)) is not None:
            key = param.group(1).strip()
            value = typed_value(self._value(param.group(2)), properties.get(key))
            piece = json.dumps(key, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False)
            self._call(out, arguments=("{" if self._params_sent == 0 else ", ") + piece)
            self._params_sent += 1
            self._pos = param.end()

    def _close(self, out: ToolParse, complete: bool) -> None:
        self._advance(out, at_close=True)
        if not self._name_sent:
            self._as_content(out, complete)
            return
        self._call(out, arguments="}" if self._params_sent else "{}")  # a call cut mid-parameter keeps the rest

    @classmethod
    def call_grammar(cls, tools: list[dict[str, Any]], function_name: str | None) -> str | None:
        functions = [t["function"] for t in tools if isinstance(t.get("function"), dict)]
        if function_name is not None:
            functions = [f for f in functions if f.get("name") == function_name]
        lines: list[str] = []
        for i, f in enumerate(functions):
            head = "" if function_name is not None else json.dumps(cls._name_tail.format(name=f["name"])) + " "
            params = cls._param_rules(i, parameters_schema(f), lines)
            lines.append(f"call{i}: {head}{params} {json.dumps(cls._call_tail)}")
        if not functions:
            return None
        return "start: " + " | ".join(f"call{i}" for i in range(len(functions))) + "\n" + "\n".join(lines)

    @classmethod
    def _param_rules(cls, i: int, schema: dict[str, Any], lines: list[str]) -> str:
        """Rules for function i's parameters (added to `lines`); returns their sequence for the call's rule."""
        properties = schema.get("properties")
        if not isinstance(properties, dict):
            properties = {}
        required = set(schema.get("required") or [])
        parts = []
        for j, (key, sub) in enumerate(properties.items()):
            rule = f"p{i}_{j}"
            lines.append(f"{rule}: {json.dumps(cls._param_open.format(key=key), ensure_ascii=False)} "
                         + cls._value_rule(rule, sub if isinstance(sub, dict) else {}, lines))
            parts.append(rule if key in required else rule + "?")
        return " ".join(parts)

    @classmethod
    def _value_rule(cls, rule: str, schema: dict[str, Any], lines: list[str]) -> str:
        """One value and its closing tag: free text (lazy: it ends at the first closing tag) for a string, one of
        the strings of an enum, or JSON of the parameter's schema."""
        from moeserve.engine.grammar import lark_regex_literal, with_json_options

        close = json.dumps(cls._value_close, ensure_ascii=False)
        kind = schema.get("type")
        is_string = kind == "string" or (isinstance(kind, list) and "string" in kind)
        enum = schema.get("enum")
        if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum) and kind in (None, "string"):
            return "(" + " | ".join(json.dumps(v, ensure_ascii=False) for v in enum) + f") {close}"
        if is_string:
            limit = schema.get("maxLength")
            length = f"{{0,{int(limit)}}}" if isinstance(limit, int) and kind == "string" else "*"
            lines.append(f"{rule}_text[lazy]: /(?s:.{length}){lark_regex_literal(cls._value_close)}/")
            return f"{rule}_text"
        return f"%json {json.dumps(with_json_options(schema), ensure_ascii=False)} {close}"


class Qwen3XmlToolParser(KeyValueToolParser):
    name = "qwen3_xml"
    _head = re.compile(r"\s*<function=([^>\n]+)>")
    _head_at_close = _head
    _param = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
    _name_tail = "{name}>\n"
    _param_open = "<parameter={key}>\n"
    _value_close = "\n</parameter>\n"
    _call_tail = "</function>\n</tool_call>"

    @classmethod
    def matches(cls, template: str) -> bool:
        return CALL_OPEN in template and "<function=" in template and "<parameter=" in template

    @staticmethod
    def _value(raw: str) -> str:
        return raw.removeprefix("\n").removesuffix("\n")  # the template writes '\n' + value + '\n'

    @staticmethod
    def forced_prefix(function_name: str | None) -> str:
        return CALL_OPEN + "\n<function=" + (f"{function_name}>\n" if function_name is not None else "")


class Glm45ToolParser(KeyValueToolParser):
    name = "glm45"
    _head = re.compile(r"\s*([^<\n]+?)[ \t]*(?=\n|<arg_key>)")  # the name, once a newline or a key follows it
    _head_at_close = re.compile(r"\s*([^<\n]+?)\s*(?=<arg_key>|$)")
    _param = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
    tags = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
    _name_tail = "{name}\n"
    _param_open = "<arg_key>{key}</arg_key>\n<arg_value>"
    _value_close = "</arg_value>\n"
    _call_tail = "</tool_call>"

    @classmethod
    def matches(cls, template: str) -> bool:
        return CALL_OPEN in template and "<arg_key>" in template and "<arg_value>" in template

    @staticmethod
    def forced_prefix(function_name: str | None) -> str:
        return CALL_OPEN + (f"{function_name}\n" if function_name is not None else "")
