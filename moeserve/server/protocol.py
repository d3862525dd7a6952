"""Request and response bodies of the OpenAI API (the subset moeserve serves), as pydantic models.

Requests accept unknown fields (clients send many we do not use); the server logs their names and ignores them,
as vLLM does. Bounds that protect the server (n, logprobs, list lengths) are enforced here, so a bad value is a
400 before anything is queued.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from moeserve.errors import RequestError

MAX_N = 64  # also capped by max_num_seqs at run time
MAX_STOP_STRINGS = 16
SEED_MAX = 2**63 - 1 - MAX_N  # the engine seeds sample i with seed + i in torch's int64 range


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    def ignored_fields(self) -> list[str]:
        """Names of request fields this server does not know (they are ignored)."""
        return sorted(self.model_extra or {})


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(RequestModel):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI names plus vLLM's extras)."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, ge=0.01, le=100)  # tiny values overflow the logits
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = Field(None, ge=-SEED_MAX, le=SEED_MAX)
    stop: str | list[str] | None = Field(None, max_length=MAX_STOP_STRINGS)
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_STRINGS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(..., min_length=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None


class ContentPart(RequestModel):
    type: str = "text"
    text: str | None = None


class FunctionCall(RequestModel):
    name: str
    arguments: str = ""


class ToolCall(RequestModel):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined). Raises RequestError for other part types (images...)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        other = [part.type for part in self.content if part.type != "text"]
        if other:
            raise RequestError(f"content parts of type {other[0]!r} are not supported (text only)",
                               param="messages")
        return "".join(part.text or "" for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(RequestModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int] = Field(..., max_length=1_000_000)


# ------------------------------------------------------------------------------------------------ responses
class UsageInfo(ResponseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "moeserve"
    max_model_len: int | None = None
    startup_choices: dict[str, str] | None = None  # moeserve's: every choice made at start-up, as logged


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(ResponseModel):
    error: ErrorInfo


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ResponseToolCall(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: dict[str, str]


class ResponseMessage(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ResponseToolCall] = Field(default_factory=list)


class ChatChoice(ResponseModel):
    index: int
    message: ResponseMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class TokenizeResponse(ResponseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(ResponseModel):
    prompt: str


class HealthResponse(ResponseModel):
    status: str  # "ok", or "degraded": serving, but some expert units failed verification (see reason)
    reason: str | None = None
