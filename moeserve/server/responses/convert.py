"""A Responses request -> the chat-completions request it means, so that it runs through the same chat formats,
tool parsers, grammars and engine as /v1/chat/completions (chat.start_chat); and a response's output -> the chat
messages a later `previous_response_id` continues from.

Input items become chat messages: `message` items keep their role (`developer` too); an assistant's `reasoning`,
`message` and `function_call` items in a row become ONE assistant message (its reasoning, content and tool calls,
as the chat template renders them back); a `function_call_output` is a `tool` message. `instructions` is a system
message first (not carried over by `previous_response_id`, as in OpenAI's API). Function tools are rendered in the
chat-completions shape; `text.format` is the chat `response_format`; `max_output_tokens` is `max_tokens`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from moeserve.errors import RequestError
from moeserve.server.protocol import ChatCompletionRequest, printable, unknown_field_message
from moeserve.server.responses.protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    InputText,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
)
from moeserve.server.typed_parts import first_error, parse_part

ITEM_TYPES: dict[str, type[BaseModel]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                    "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}
TEXT_PARTS = ("input_text", "output_text", "text")
TEXT_FORMAT_KEYS = ["type", "name", "schema", "strict", "description"]
EFFORTS = ("low", "medium", "high")

# Accepted, with no effect on the output (documentation; tests check each is a known field).
IGNORED = {
    "metadata": "tags for stored responses; echoed back",
    "user": "an end-user id for abuse monitoring",
    "include": "nothing extra to include: reasoning items carry their text, there is no encrypted content",
    "service_tier": "one tier",
    "prompt_cache_key": "prefix caching is automatic",
    "prompt_cache_retention": "prefix caching is automatic",
    "prompt_cache_options": "prefix caching is automatic",
    "safety_identifier": "an end-user id for abuse monitoring",
    "reasoning.summary": "no summaries: reasoning items carry the reasoning text itself",
    "stream_options.include_obfuscation": "no padding is added",
    "tools[].strict": "the arguments follow the schema whenever tool_choice forces a call, strict or not",
}

# (field, is this value refused?, why)
REFUSED: list[tuple[str, Any, str]] = [
    ("background", lambda r: bool(r.background), "is not supported: a response is made while the request waits"),
    ("conversation", lambda r: r.conversation is not None, "is not supported; use previous_response_id"),
    ("prompt", lambda r: r.prompt is not None, "(a stored prompt template) is not supported"),
    ("truncation", lambda r: r.truncation == "auto",
     "'auto' is not supported: a conversation longer than the context is a 400"),
    ("top_logprobs", lambda r: bool(r.top_logprobs), "is not supported on /v1/responses (it is on chat completions)"),
    ("max_tool_calls", lambda r: r.max_tool_calls is not None, "is not supported; parallel_tool_calls false "
     "allows one call"),
    ("context_management", lambda r: r.context_management is not None, "is not supported"),
    ("moderation", lambda r: r.moderation is not None, "is not supported"),
    ("text.verbosity", lambda r: r.text is not None and r.text.verbosity is not None,
     "is not supported (no model served here reads it); say it in the instructions"),
    ("reasoning.generate_summary", lambda r: r.reasoning is not None and r.reasoning.generate_summary is not None,
     "is not supported"),
]


def check_fields(req: ResponsesRequest) -> None:
    """Raise RequestError (400) for a field set to something moeserve cannot honour."""
    for name, refused, why in REFUSED:
        if refused(req):
            raise RequestError(f"{name} {why}", param=name)


def chat_request(req: ResponsesRequest, conversation: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat-completions request `req` means: its instructions, then `conversation` (a stored conversation and
    `req.input` as chat messages)."""
    check_fields(req)
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    messages += conversation
    fields: dict[str, Any] = {
        "model": req.model, "messages": messages, "max_tokens": req.max_output_tokens, "stream": False,
        "tools": chat_tools(req.tools), "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": response_format(req.text.format if req.text else None),
        "reasoning_effort": reasoning_effort(req),
    }
    if req.tool_choice is not None:
        choice = req.tool_choice
        fields["tool_choice"] = choice if isinstance(choice, str) else \
            {"type": "function", "function": {"name": choice.name}}
    for name in ("temperature", "top_p", "seed", "stop", "top_k", "min_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty", "chat_template_kwargs"):
        fields[name] = getattr(req, name)
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as err:  # a message built from a checked item: only its content can be wrong here
        first = err.errors()[0]
        raise RequestError(f"input: {first['msg']}", param="input") from None


def reasoning_effort(req: ResponsesRequest) -> str | None:
    effort = req.reasoning.effort if req.reasoning is not None else None
    if effort is not None and effort not in EFFORTS:
        raise RequestError(f"reasoning.effort {effort!r} is not supported here: give one of {', '.join(EFFORTS)}",
                           param="reasoning.effort")
    return effort


def response_format(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """text.format -> the chat response_format (structured.py checks the schema)."""
    if value is None:
        return None
    for name in value:
        if name not in TEXT_FORMAT_KEYS:
            message = unknown_field_message(str(name), TEXT_FORMAT_KEYS)
            raise RequestError(message.replace("supplied: '", "supplied: 'text.format.", 1),
                               param=f"text.format.{printable(str(name))}")
    kind = value.get("type")
    if kind == "json_schema":
        if "schema" not in value:
            raise RequestError("text.format.schema is required with type 'json_schema'", param="text.format.schema")
        return {"type": "json_schema", "json_schema": {k: v for k, v in value.items() if k != "type"}}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise RequestError(f"text.format.type must be 'text', 'json_object' or 'json_schema', got "
                       f"{printable(str(kind))!r}", param="text.format.type")


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools (flat) -> chat tools ({type, function: {...}}), key order kept."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise RequestError(f"tools[{i}]: only function tools are supported, not {printable(str(tool.get('type')))!r}",
                               param="tools")
        try:
            FunctionTool.model_validate(tool)
        except ValidationError as err:
            raise RequestError(f"tools[{i}]: {first_error(err)}; a tool is {{'type': 'function', 'name': ..., "
                               "'description': ..., 'parameters': {...}}", param="tools") from None
        out.append({"type": "function", "function": {k: v for k, v in tool.items()
                                                     if k not in ("type", "defer_loading")}})
    return out


def _item(i: int, raw: dict[str, Any]) -> Any:
    # a message may leave its type out ({"role": ..., "content": ...})
    return parse_part(raw, ITEM_TYPES, f"input[{i}]", "input", default_type="message")


def _text(i: int, content: str | list[InputText]) -> str:
    if isinstance(content, str):
        return content
    other = [part.type for part in content if part.type not in TEXT_PARTS]
    if other:
        raise RequestError(f"input[{i}]: content parts of type {printable(other[0])!r} are not supported (text only)",
                           param="input")
    return "".join(part.text or "" for part in content)


def input_messages(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input -> chat messages (dicts in ChatMessage's shape)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    out: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the assistant message being put together

    def assistant(starts_new: bool) -> dict[str, Any]:
        nonlocal turn
        if turn is None or starts_new:
            turn = {"role": "assistant", "content": ""}
            out.append(turn)
        return turn

    for i, raw in enumerate(value):
        item = _item(i, raw)
        if isinstance(item, ReasoningItem):
            t = assistant(turn is not None and bool(turn["content"] or turn.get("tool_calls")))
            parts = item.content if item.content else item.summary
            t["reasoning"] = t.get("reasoning", "") + "".join(part.text for part in parts)
        elif isinstance(item, MessageItem) and item.role == "assistant":
            t = assistant(turn is not None and bool(turn.get("tool_calls")))
            t["content"] += _text(i, item.content)
        elif isinstance(item, FunctionCallItem):
            t = assistant(False)
            t.setdefault("tool_calls", []).append({"id": item.call_id, "type": "function",
                                                   "function": {"name": item.name, "arguments": item.arguments}})
        else:
            turn = None
            if isinstance(item, FunctionCallOutputItem):
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(i, item.output)})
            else:
                out.append({"role": item.role, "content": _text(i, item.content)})
    return out


def output_message(reasoning: str, content: str, calls: list[tuple[str, str, str]]) -> dict[str, Any]:
    """A response's output as the assistant chat message a later turn renders back. calls: (id, name, args)."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning"] = reasoning
    if calls:
        message["tool_calls"] = [{"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                                 for i, n, a in calls]
    return message
