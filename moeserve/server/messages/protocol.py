"""Request bodies of the Anthropic Messages API (POST /v1/messages), as pydantic models: strict like every request
here (an unknown field is a 400 with a "did you mean", in Anthropic's error shape). Content blocks are checked one
by one, by their `type`, in convert.py."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from moeserve.server.protocol import MAX_STOP_STRINGS, RequestModel


class TextBlock(RequestModel):
    type: Literal["text"]
    text: str
    cache_control: Any = None  # prefix caching is automatic
    citations: Any = None  # not rendered


class ToolUseBlock(RequestModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: Any = None
    caller: Any = None


class ToolResultBlock(RequestModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[dict[str, Any]] | None = None  # text blocks only
    is_error: bool | None = None  # not rendered: the result's text says what happened
    cache_control: Any = None


class ThinkingBlock(RequestModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None  # not checked: moeserve signs nothing


class RedactedThinkingBlock(RequestModel):
    type: Literal["redacted_thinking"]
    data: str


class InputMessage(RequestModel):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class CustomTool(RequestModel):
    name: str = Field(..., min_length=1, max_length=64)
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: Any = None
    strict: bool | None = None
    defer_loading: bool | None = None
    eager_input_streaming: bool | None = None
    input_examples: Any = None
    allowed_callers: Any = None


class ToolChoice(RequestModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(RequestModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1)  # no separate budget here: max_tokens bounds thinking and answer
    display: str | None = None


class OutputConfig(RequestModel):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: dict[str, Any] | None = None  # {type: json_schema, schema: {...}}: checked in convert.py


class MessagesRequest(RequestModel):
    model: str | None = None
    max_tokens: int = Field(..., ge=1)
    messages: list[InputMessage] = Field(..., min_length=1, max_length=100_000)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    # Kept as sent and checked in convert.py (custom tools with input_schema; server tools are refused)
    tools: list[dict[str, Any]] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    # Anthropic fields that change nothing here (IGNORED in convert.py), or are refused when set (REFUSED there)
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    cache_control: Any = None
    container: Any = None
    context_management: Any = None
    mcp_servers: Any = None
    inference_geo: str | None = None
    speed: str | None = None


class CountTokensRequest(RequestModel):
    """POST /v1/messages/count_tokens: what a Messages request's prompt would take, without generating."""

    model: str | None = None
    messages: list[InputMessage] = Field(..., min_length=1, max_length=100_000)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    cache_control: Any = None
    context_management: Any = None
    mcp_servers: Any = None

    def as_messages_request(self) -> MessagesRequest:
        return MessagesRequest.model_validate({**self.model_dump(exclude_none=True), "max_tokens": 1})
