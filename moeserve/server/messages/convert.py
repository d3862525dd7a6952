"""An Anthropic Messages request -> the chat-completions request it means, so that it runs through the same chat
formats, tool parsers, grammars and engine as /v1/chat/completions (chat.start_chat).

`system` (a string or text blocks) is a system message first. A user message's `tool_result` blocks become `tool`
messages (before its text, which becomes a user message); an assistant message's `thinking` blocks become its
reasoning, `text` its content and `tool_use` its tool calls (the input as JSON arguments), as the chat template
renders them back. Tools (`input_schema`) are chat function tools; tool_choice auto / any / tool / none is chat's
auto / required / a named function / none, `disable_parallel_tool_use` is `parallel_tool_calls: false`.
`thinking` switches the template's thinking on or off where it has that switch (`enable_thinking`); without the
parameter the template's default holds (and thinking the model writes is returned as thinking blocks).
`output_config.format` (json_schema) is the chat `response_format`; `output_config.effort` its `reasoning_effort`.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ValidationError

from moeserve.errors import RequestError
from moeserve.server.chat_format import ChatFormat
from moeserve.server.messages.protocol import (
    CustomTool,
    MessagesRequest,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from moeserve.server.protocol import ChatCompletionRequest, printable
from moeserve.server.typed_parts import first_error, parse_part

BLOCK_TYPES: dict[str, type[BaseModel]] = {"text": TextBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock,
                                     "thinking": ThinkingBlock, "redacted_thinking": RedactedThinkingBlock}
EFFORTS = ("low", "medium", "high")

# Accepted, with no effect on the output (documentation; tests check each is a known field).
IGNORED = {
    "metadata": "an end-user id for abuse monitoring",
    "service_tier": "one tier",
    "cache_control": "prefix caching is automatic (also on blocks and tools)",
    "inference_geo": "one place",
    "speed": "one speed",
    "thinking.budget_tokens": "no separate thinking budget: max_tokens bounds thinking and answer together",
    "thinking.display": "thinking is shown as the model wrote it",
    "messages[].content[].signature": "thinking blocks are not signed here",
    "messages[].content[].is_error": "the tool result's text says what happened",
}

# (field, is this value refused?, why)
REFUSED: list[tuple[str, Any, str]] = [
    ("container", lambda r: r.container is not None, "is not supported (no code execution here)"),
    ("context_management", lambda r: r.context_management is not None, "is not supported"),
    ("mcp_servers", lambda r: bool(r.mcp_servers), "is not supported: define the tools in tools"),
]


def chat_request(req: MessagesRequest, chat_format: ChatFormat) -> ChatCompletionRequest:
    """The chat-completions request `req` means, for the served model's chat format."""
    for name, refused, why in REFUSED:
        if refused(req):
            raise RequestError(f"{name} {why}", param=name)
    if req.messages[-1].role == "assistant":  # the template would close that turn and open another: not a prefill
        raise RequestError("a last assistant message (a prefill the answer continues) is not supported: end with a "
                           "user message", param="messages")
    messages: list[dict[str, Any]] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else _text(req.system, "system")
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(req.messages):
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
        elif message.role == "user":
            messages += _user(i, message.content)
        else:
            messages.append(_assistant(i, message.content))
    fields: dict[str, Any] = {
        "model": req.model, "messages": messages, "max_tokens": req.max_tokens, "stop": req.stop_sequences,
        "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "tools": chat_tools(req.tools),
    }
    fields.update(_tool_choice(req))
    fields.update(_output_config(req))
    if req.thinking is not None and req.thinking.type != "adaptive":
        switch = chat_format.thinking_switch(req.thinking.type == "enabled")
        if switch is None and req.thinking.type == "disabled":
            raise RequestError("thinking: this model's chat format has no switch to turn thinking off",
                               param="thinking")
        fields["chat_template_kwargs"] = switch
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as err:
        raise RequestError(f"messages: {err.errors()[0]['msg']}", param="messages") from None


def _tool_choice(req: MessagesRequest) -> dict[str, Any]:
    choice = req.tool_choice
    if choice is None:
        return {}
    if choice.type == "tool" and not choice.name:
        raise RequestError("tool_choice.name is required with type 'tool'", param="tool_choice.name")
    named = {"type": "function", "function": {"name": choice.name}}
    mapped = {"auto": "auto", "any": "required", "none": "none", "tool": named}[choice.type]
    out: dict[str, Any] = {"tool_choice": mapped}
    if choice.disable_parallel_tool_use:
        out["parallel_tool_calls"] = False
    return out


def _output_config(req: MessagesRequest) -> dict[str, Any]:
    config = req.output_config
    if config is None:
        return {}
    out: dict[str, Any] = {}
    if config.effort is not None:
        if config.effort not in EFFORTS:
            raise RequestError(f"output_config.effort {config.effort!r} is not supported here: give one of "
                               f"{', '.join(EFFORTS)}", param="output_config.effort")
        out["reasoning_effort"] = config.effort
    if config.format is not None:
        unknown = [k for k in config.format if k not in ("type", "schema")]
        if config.format.get("type") != "json_schema" or "schema" not in config.format or unknown:
            raise RequestError("output_config.format must be {'type': 'json_schema', 'schema': {...}}",
                               param="output_config.format")
        out["response_format"] = {"type": "json_schema",
                                  "json_schema": {"name": "output", "schema": config.format["schema"]}}
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Anthropic tools (name, description, input_schema) -> chat function tools."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") not in (None, "custom"):
            raise RequestError(f"tools[{i}]: server tools ({printable(str(tool.get('type')))!r}) are not supported; "
                               "give client tools {'name': ..., 'description': ..., 'input_schema': {...}}",
                               param="tools")
        try:
            checked = CustomTool.model_validate(tool)
        except ValidationError as err:
            raise RequestError(f"tools[{i}]: {first_error(err)}; a tool is {{'name': ..., 'description': ..., "
                               "'input_schema': {...}}", param="tools") from None
        function: dict[str, Any] = {"name": checked.name}
        if checked.description is not None:
            function["description"] = checked.description
        function["parameters"] = checked.input_schema
        out.append({"type": "function", "function": function})
    return out


def _block(where: str, raw: dict[str, Any]) -> Any:
    return parse_part(raw, BLOCK_TYPES, where, "messages")


def _text(blocks: list[dict[str, Any]], where: str) -> str:
    """Text blocks joined (system, a tool result's content)."""
    parts = []
    for j, raw in enumerate(blocks):
        block = _block(f"{where}[{j}]", raw)
        if not isinstance(block, TextBlock):
            raise RequestError(f"{where}[{j}]: only text blocks are allowed here", param="messages")
        parts.append(block.text)
    return "".join(parts)


def _user(i: int, content: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A user message's blocks: its tool results as tool messages, then its text as a user message."""
    results, text = [], []
    for j, raw in enumerate(content):
        block = _block(f"messages[{i}].content[{j}]", raw)
        if isinstance(block, ToolResultBlock):
            value = block.content if isinstance(block.content, str) or block.content is None else \
                _text(block.content, f"messages[{i}].content[{j}].content")
            results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": value or ""})
        elif isinstance(block, TextBlock):
            text.append(block.text)
        else:
            raise RequestError(f"messages[{i}].content[{j}]: a user message holds text and tool_result blocks, not "
                               f"{block.type}", param="messages")
    return results + ([{"role": "user", "content": "".join(text)}] if text else [])


def _assistant(i: int, content: list[dict[str, Any]]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    for j, raw in enumerate(content):
        block = _block(f"messages[{i}].content[{j}]", raw)
        if isinstance(block, ThinkingBlock):
            message["reasoning"] = message.get("reasoning", "") + block.thinking
        elif isinstance(block, TextBlock):
            message["content"] += block.text
        elif isinstance(block, ToolUseBlock):
            message.setdefault("tool_calls", []).append(
                {"id": block.id, "type": "function",
                 "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif not isinstance(block, RedactedThinkingBlock):  # redacted thinking: nothing to render
            raise RequestError(f"messages[{i}].content[{j}]: an assistant message holds text, thinking and "
                               f"tool_use blocks, not {block.type}", param="messages")
    return message
