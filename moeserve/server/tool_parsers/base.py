"""The tool-call parsers' interface and shared parts (`ToolParser`, `TaggedToolParser`, call grammars) and the
Qwen3 JSON format; the registry that picks a format from a chat template is this package's `__init__.py`, the XML,
GLM, DeepSeek and Kimi-K2 formats are `xml.py`, `deepseek.py` and `kimi.py` (kept apart so no module imports back
into the registry).

Tool calls in a model's text output, one parser class per format behind `ToolParser`, picked from the chat
template by `tool_parser_for` (callers never branch on the format).

Formats:
- `qwen3_json` (Qwen3, Qwen2.5, Hermes): `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`; the
  arguments stream as the model writes them (the JSON text between the braces, as written).
- `qwen3_xml` (Qwen3-Coder, Qwen3.5): `<tool_call>\\n<function=f>\\n<parameter=x>\\nvalue\\n</parameter>\\n
  </function>\\n</tool_call>`; each parameter is added to the arguments JSON once its closing tag arrives, its
  value typed by the tool's JSON schema (string unless the schema says otherwise).

Streaming-safe: text that may be the start of `<tool_call>` is held back, so no partial tag reaches `content`;
whitespace just before a tool call (or after the last one) is layout and dropped. A block that does not parse as a
call is returned as content, never lost. Feeding the text in any pieces gives the same result as feeding it whole.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moeserve.server.reasoning import partial_tag_len

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class ToolCallDelta:
    """What one tool call gained: `name` on its first delta, then pieces of its arguments (JSON text). `call_id`:
    the call's id where the format has its own (Kimi-K2's `functions.NAME:IDX`, on the first delta), else None
    (the server gives one)."""

    index: int
    name: str | None = None
    arguments: str = ""
    call_id: str | None = None


@dataclass
class ToolParse:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


class ToolParser(ABC):
    """Per-output state: feeds of answer text (reasoning already removed) -> content and tool-call deltas."""

    name: str

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        self.tools = {t["function"]["name"]: t["function"] for t in tools if isinstance(t.get("function"), dict)}

    @classmethod
    @abstractmethod
    def matches(cls, template: str) -> bool:
        """Whether a chat template renders tool calls in this format."""

    @abstractmethod
    def feed(self, text: str) -> ToolParse:
        """Content and tool-call deltas gained with this text."""

    @abstractmethod
    def flush(self) -> ToolParse:
        """At the end of the output (also a stop string that cut it): what was held back, and a call cut short
        closed as far as it can be."""

    @staticmethod
    @abstractmethod
    def forced_prefix(function_name: str | None) -> str:
        """Text that starts a tool call (of `function_name`, or of a function the model names), appended to the
        prompt when tool_choice demands a call."""

    @classmethod
    def call_grammar(cls, tools: list[dict[str, Any]], function_name: str | None) -> str | None:
        """A Lark grammar (llguidance's, with `%json`) for the rest of one call after `forced_prefix`, its arguments
        following the function's parameters schema; None when the format is not constrained (the model's own
        arguments are parsed)."""
        return None

    stop_after_call: str | None = CALL_CLOSE  # a stop string ending the output after one call (no parallel calls)
    tags: tuple[str, ...] = (CALL_OPEN, CALL_CLOSE)  # the format's markers, which the output text must keep
    # How the format's template reads an assistant call's arguments: a mapping (transformers' convention: Qwen,
    # GLM) or the JSON text as sent (DeepSeek's template concatenates it into the prompt).
    template_arguments: str = "mapping"


def parameters_schema(function: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters schema (any object when it has none), as a JSON schema for a grammar."""
    from moeserve.engine.grammar import with_json_options

    schema = function.get("parameters")
    return with_json_options(schema if isinstance(schema, dict) and schema else {"type": "object"})


class TaggedToolParser(ToolParser):
    """Calls in `call_open ... call_close` blocks (`<tool_call>...</tool_call>` unless a subclass says otherwise),
    with text outside them as content; `layout_tags` outside a block (a format's wrapper around its calls) are
    dropped like the whitespace before a call. Subclasses parse a block's body as it grows (`_advance`) and when it
    ends (`_close`)."""

    call_open: str = CALL_OPEN
    call_close: str = CALL_CLOSE
    layout_tags: tuple[str, ...] = ()

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        super().__init__(tools)
        self._pending = ""  # outside a call: a possible partial <tool_call> or whitespace; inside: the body
        self._inside = False
        self._body = ""
        self._index = -1  # index of the current (or last) call
        self._name_sent = False
        self._gap = ""  # the whitespace dropped before the current block

    @classmethod
    def matches(cls, template: str) -> bool:
        return cls.call_open in template

    def _next_tag(self) -> tuple[int, str]:
        """The first tag in the pending text that changes state (-1 when none): the block's end inside a block;
        outside, a block's start or a layout tag."""
        tags = (self.call_close,) if self._inside else (self.call_open, *self.layout_tags)
        found = [(at, tag) for tag in tags if (at := self._pending.find(tag)) >= 0]
        return min(found) if found else (-1, "")

    def feed(self, text: str) -> ToolParse:
        out = ToolParse()
        self._pending += text
        while True:
            at, tag = self._next_tag()
            if at < 0:
                break
            if self._inside:
                self._body += self._pending[:at]
                self._close(out, complete=True)
            else:
                before = self._pending[:at]
                out.content += before.rstrip()  # whitespace before a call is layout ...
                self._gap = before[len(before.rstrip()):]  # ... unless the block is not a call after all
                if tag != self.call_open:  # a layout tag: dropped
                    self._pending = self._pending[at + len(tag):]
                    continue
                self._index += 1
                self._body, self._name_sent = "", False
            self._pending = self._pending[at + len(tag):]
            self._inside = not self._inside
        tags = (self.call_close,) if self._inside else (self.call_open, *self.layout_tags)
        keep = max(partial_tag_len(self._pending, tag) for tag in tags)
        ready = self._pending[:len(self._pending) - keep]
        if self._inside:
            self._body += ready
            self._advance(out)
        else:
            stripped = ready.rstrip()  # trailing whitespace waits: dropped if a call follows
            keep += len(ready) - len(stripped)
            out.content += stripped
        self._pending = self._pending[len(self._pending) - keep:] if keep else ""
        return out

    def flush(self) -> ToolParse:
        out = ToolParse()
        if self._inside:
            self._body += self._pending
            self._close(out, complete=False)
        elif self._index < 0:  # no call at all: trailing whitespace is part of the answer
            out.content = self._pending
        self._pending = ""
        return out

    def _call(self, out: ToolParse, name: str | None = None, arguments: str = "", call_id: str | None = None
              ) -> None:
        if name is not None:
            self._name_sent = True
        if name is not None or arguments:
            out.calls.append(ToolCallDelta(self._index, name, arguments, call_id))

    def _as_content(self, out: ToolParse, complete: bool) -> None:
        """A block that is not a call: its text, tags included, is content."""
        out.content += self._gap + self.call_open + self._body + (self.call_close if complete else "")
        self._index -= 1

    @abstractmethod
    def _advance(self, out: ToolParse) -> None:
        """The body grew (self._body): add what is certain to `out`."""

    @abstractmethod
    def _close(self, out: ToolParse, complete: bool) -> None:
        """The body ended (`complete`: with </tool_call>; else the output stopped): add the rest to `out`."""


# ----------------------------------------------------------------------------------------------- qwen3 json
_JSON_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def json_value_end(text: str) -> int | None:
    """End of the JSON object or array at the start of `text` (leading whitespace allowed), or None while it is
    still open. Strings and escapes are followed, so braces inside strings do not count."""
    depth, in_string, escaped = 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def json_arguments_piece(args: str, sent: int) -> tuple[str, int]:
    """The arguments text (a JSON object or array, leading whitespace dropped) that arrived past the `sent` first
    characters, up to the value's end: (piece, characters sent now). A string or scalar value waits for the close."""
    stripped = args.lstrip()
    if not stripped or stripped[0] not in "{[":
        return "", sent
    end = json_value_end(stripped)
    upto = len(stripped) if end is None else end
    return (stripped[sent:upto], upto) if upto > sent else ("", sent)


class Qwen3JsonToolParser(TaggedToolParser):
    name = "qwen3_json"

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        super().__init__(tools)
        self._args_start = 0  # where the arguments value starts in the body
        self._args_sent = 0  # characters of it already sent

    def _advance(self, out: ToolParse) -> None:
        if not self._name_sent:
            head = _JSON_HEAD.match(self._body)
            if head is None:
                return
            self._call(out, name=json.loads(f'"{head.group(1)}"'))
            self._args_start, self._args_sent = head.end(), 0
        piece, self._args_sent = json_arguments_piece(self._body[self._args_start:], self._args_sent)
        self._call(out, arguments=piece)

    def _close(self, out: ToolParse, complete: bool) -> None:
        self._advance(out)
        if self._name_sent:
            if self._args_sent == 0:  # arguments not an object: take them from the parsed block
                parsed = _loads(self._body)
                value = parsed.get("arguments", parsed.get("parameters")) if isinstance(parsed, dict) else None
                if value is not None:
                    self._call(out, arguments=value if isinstance(value, str) else json.dumps(value))
            return
        parsed = _loads(self._body)  # keys in another order: the whole block at once
        if isinstance(parsed, dict) and isinstance(parsed.get("name"), str):
            value = parsed.get("arguments", parsed.get("parameters", {}))
            self._call(out, name=parsed["name"])
            self._call(out, arguments=value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))
        else:
            self._as_content(out, complete)

    @staticmethod
    def forced_prefix(function_name: str | None) -> str:
        if function_name is None:
            return CALL_OPEN + '\n{"name": "'
        return CALL_OPEN + '\n{"name": ' + json.dumps(function_name) + ', "arguments": '

    @classmethod
    def call_grammar(cls, tools: list[dict[str, Any]], function_name: str | None) -> str | None:
        # after the forced prefix: [name", "arguments": ]{arguments}}\n</tool_call>
        def head(name: str) -> str:
            return json.dumps(name, ensure_ascii=False)[1:-1] + '", "arguments": '  # as written inside the string

        return json_call_grammar(tools, function_name, head, "}\n" + CALL_CLOSE)


class JsonArgumentsToolParser(TaggedToolParser):
    """Calls whose body is a head (the function's name, and the call's id where the format writes one) then the
    arguments as JSON text, which stream as the model writes them (DeepSeek-V3, Kimi-K2). Subclasses read the head
    (`_head`) and may clean arguments that are not an object (`_raw_arguments`)."""

    template_arguments = "text"  # their templates print an earlier call's arguments as text

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        super().__init__(tools)
        self._args_start = 0  # where the arguments start in the body
        self._args_sent = 0

    @abstractmethod
    def _head(self, at_close: bool) -> tuple[str, int, str | None] | None:
        """(function name, where its arguments start in the body, the call's id or None) once the body says them
        (`at_close`: the block has ended, nothing more will come), else None."""

    @staticmethod
    def _raw_arguments(text: str) -> str:
        """Arguments that are not a JSON object, as the call's arguments."""
        return text.strip()

    def _advance(self, out: ToolParse, at_close: bool = False) -> None:
        if not self._name_sent:
            head = self._head(at_close)
            if head is None or not head[0]:
                return
            self._call(out, name=head[0], call_id=head[2])
            self._args_start, self._args_sent = head[1], 0
        piece, self._args_sent = json_arguments_piece(self._body[self._args_start:], self._args_sent)
        self._call(out, arguments=piece)

    def _close(self, out: ToolParse, complete: bool) -> None:
        self._advance(out, at_close=True)
        if not self._name_sent:  # no head: not a call
            self._as_content(out, complete)
            return
        if self._args_sent == 0:  # not an object (or none): the text as written
            self._call(out, arguments=self._raw_arguments(self._body[self._args_start:]) or "{}")


def json_call_grammar(tools: list[dict[str, Any]], function_name: str | None, head: Callable[[str], str],
                      tail: str, between: str = "") -> str | None:
    """A Lark grammar for the rest of one call whose arguments are JSON: one rule per function (only the named
    one when `function_name` is given: the prefix already named it, else `head(name)` comes first), then
    `between` (Lark items, e.g. a call index the model writes), the arguments following the function's parameters
    schema, then `tail`."""
    functions = [t["function"] for t in tools if isinstance(t.get("function"), dict)]
    if function_name is not None:
        functions = [f for f in functions if f.get("name") == function_name]
    rules = []
    for i, f in enumerate(functions):
        start = "" if function_name is not None else json.dumps(head(f["name"]), ensure_ascii=False)
        schema = json.dumps(parameters_schema(f), ensure_ascii=False)
        rules.append(f"call{i}: {start} {between} %json {schema} " + json.dumps(tail, ensure_ascii=False))
    if not rules:
        return None
    return "start: " + " | ".join(f"call{i}" for i in range(len(rules))) + "\n" + "\n".join(rules)


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None
