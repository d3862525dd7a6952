"""Request bodies of the OpenAI Responses API (POST /v1/responses), as pydantic models: strict like every request
here (an unknown field is a 400 with a "did you mean"). Input items are checked one by one, by their `type`, in
convert.py (their shapes differ by type; a pydantic union would blur the error of a bad one)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from moeserve.server.protocol import MAX_STOP_STRINGS, SEED_MAX, RequestModel


class InputText(RequestModel):
    """A content part of an input message: input_text / output_text (others are known, and refused)."""

    type: str
    text: str | None = None
    annotations: list[Any] | None = None  # of an earlier output_text: not rendered
    logprobs: list[Any] | None = None  # of an earlier output_text: not rendered
    image_url: Any = None
    file_id: Any = None
    file_data: Any = None
    file_url: Any = None
    filename: Any = None
    detail: Any = None
    refusal: str | None = None


class MessageItem(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None
    phase: str | None = None


class FunctionCallItem(RequestModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None
    namespace: str | None = None


class FunctionCallOutputItem(RequestModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None


class ReasoningText(RequestModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(RequestModel):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: str | None = None


class FunctionTool(RequestModel):
    type: Literal["function"]
    name: str = Field(..., min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    defer_loading: bool | None = None


class NamedFunctionChoice(RequestModel):
    type: Literal["function"]
    name: str


class TextConfig(RequestModel):
    # {type: text | json_object | json_schema, name, schema, strict, description}: checked in convert.py
    format: dict[str, Any] | None = None
    verbosity: str | None = None  # refused when set (as in chat completions)


class ReasoningConfig(RequestModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: str | None = None  # no summaries: reasoning items carry the reasoning text itself
    generate_summary: str | None = None


class ResponsesStreamOptions(RequestModel):
    include_obfuscation: bool | None = None  # OpenAI's padding against side channels; nothing to pad here


class ResponsesRequest(RequestModel):
    model: str | None = None
    # a string, or items (checked in convert.py: message, function_call, function_call_output, reasoning)
    input: str | Annotated[list[dict[str, Any]], Field(max_length=100_000)]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    # Kept as sent and checked in convert.py (function tools only); rendered by the chat template in the
    # chat-completions shape.
    tools: list[dict[str, Any]] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    # vLLM's extensions (sampling beyond OpenAI's, as in chat completions)
    seed: int | None = Field(None, ge=-SEED_MAX, le=SEED_MAX)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, ge=0.01, le=100)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI fields that change nothing here (IGNORED in convert.py), or are refused when set (REFUSED there).
    metadata: dict[str, Any] | None = None
    user: str | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: Any = None
    safety_identifier: str | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_tool_calls: int | None = Field(None, ge=1)
    context_management: Any = None
    moderation: Any = None
