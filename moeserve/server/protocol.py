"""Request and response bodies of the OpenAI API (the subset moeserve serves), as pydantic models.

Requests are strict like the OpenAI API: an unknown field is a 400 naming it, with a "did you mean" (a typo such as
`max_tokns` must not silently run to the full context). Every field of OpenAI's request schema is known; those
moeserve accepts but ignores, and those it refuses when set, are listed in request_fields.py. Bounds that protect
the server (n, logprobs, list lengths) are enforced here, so a bad value is a 400 before anything is queued.
"""

from __future__ import annotations

import difflib
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from moeserve.errors import RequestError

MAX_N = 64  # also capped by max_num_seqs at run time
MAX_STOP_STRINGS = 16
SEED_MAX = 2**63 - 1 - MAX_N  # the engine seeds sample i with seed + i in torch's int64 range


MAX_FIELD_NAME_CHARS = 40  # an unknown field's name is quoted in the error, cut to this


def printable(name: str) -> str:
    """A client-chosen name made safe to quote in an error or a log line: escaped, cut."""
    return name[:MAX_FIELD_NAME_CHARS].encode("unicode_escape", "backslashreplace").decode("ascii")


def unknown_field_message(name: str, known: list[str]) -> str:
    """One line for an unknown request field: OpenAI's wording plus the closest known name, if one is close."""
    shown = "'" + printable(name) + ("..." if len(name) > MAX_FIELD_NAME_CHARS else "") + "'"
    close = difflib.get_close_matches(name[:100], known, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"Unrecognized request argument supplied: {shown}{hint}"


class RequestModel(BaseModel):
    """A request body (or part of one): unknown fields are refused with a "did you mean"."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _known_fields_only(cls, data: Any) -> Any:
        if isinstance(data, dict):
            known = list(cls.model_fields)
            for name in data:
                if name not in cls.model_fields:
                    raise PydanticCustomError("unrecognized_argument", unknown_field_message(str(name), known),
                                              {"field": printable(str(name))})
        return data


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's; refused when true (not implemented)
    include_obfuscation: bool | None = None  # OpenAI's padding against side channels; nothing to pad here


class SamplingFields(RequestModel):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI names plus vLLM's extras)."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=2**24)  # and at most the vocabulary (request_fields.check_ranges)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, ge=0.01, le=100)  # tiny values overflow the logits
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = Field(None, ge=-SEED_MAX, le=SEED_MAX)
    # At most MAX_STOP_STRINGS items (OpenAI allows 4); one string may be any length; "" stops nothing (dropped).
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_STRINGS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Structured output (structured.py): OpenAI's response_format, vLLM's structured_outputs and guided_* forms.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, max_length=1024)
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # refused unless unset or llguidance's name
    guided_whitespace_pattern: str | None = None  # refused when set
    # OpenAI fields that change nothing here (see request_fields.py), or refused when set to what we cannot do.
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's router writes these SGLang/vLLM fields into every request it forwards: accepted at their neutral value
    # (request_fields.ROUTER_FIELDS), refused otherwise; regex and ebnf are honoured as guided_regex / guided_grammar.
    no_stop_trim: bool = False
    return_hidden_states: bool = False
    lora_path: Any = None
    session_params: dict[str, Any] | None = None  # only session_id, the router's affinity key, is accepted
    regex: str | None = None
    ebnf: str | None = None


class CompletionRequest(SamplingFields):
    # "" reaches the engine's check ("the prompt is empty"): a length error about "items" would puzzle for a string
    prompt: str | Annotated[list[str] | list[int] | list[list[int]], Field(min_length=1)]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    json_schema: dict[str, Any] | str | None = None  # SGLang's form of guided_json (structured.py)


class ContentPart(RequestModel):
    type: str = "text"
    text: str | None = None
    # Other OpenAI part types are known (so they get "not supported", not "unrecognized"), and refused.
    image_url: Any = None
    input_audio: Any = None
    file: Any = None
    refusal: str | None = None


class FunctionCall(RequestModel):
    name: str
    arguments: str = ""


class ToolCall(RequestModel):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(RequestModel):
    name: str = Field(..., min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the arguments follow the schema whenever tool_choice forces a call (chat_format.py)


class Tool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    refusal: str | None = None  # an earlier assistant refusal; not rendered (templates have no place for it)
    audio: Any = None  # refused when set
    function_call: Any = None  # the deprecated form of tool_calls; refused when set

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
    # Kept as sent: the chat template renders them (key order included) as transformers would. Checked in
    # checked_tools() against the Tool model.
    tools: list[dict[str, Any]] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    # OpenAI fields that change nothing here, or are refused when set (request_fields.py says which).
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: Any = None
    safety_identifier: str | None = None
    prediction: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    web_search_options: Any = None
    verbosity: str | None = None
    moderation: Any = None
    functions: Any = None
    function_call: Any = None
    # vLLM's extensions
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's router writes these too (request_fields.ROUTER_FIELDS): accepted at their neutral value
    continue_final_message: bool = False
    echo: bool = False
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    include_reasoning: bool = True

    def checked_tools(self) -> list[Tool]:
        """The tools as models; raises RequestError naming the bad one."""
        out = []
        for i, tool in enumerate(self.tools or []):
            try:
                out.append(Tool.model_validate(tool))
            except ValidationError as err:
                first = err.errors()[0]
                where = ".".join(str(p) for p in first["loc"] if isinstance(p, int) or str(p).isidentifier())
                why = f"{where}: {first['msg']}" if where else first["msg"]
                raise RequestError(f"tools[{i}]: {why}; a tool is {{'type': 'function', 'function': "
                                   "{'name': ..., 'description': ..., 'parameters': {...}}}", param="tools") from None
        return out


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
    # moeserve's, with ?verbose=true: every choice made at start-up, as logged, and the request sampling defaults
    startup_choices: dict[str, str] | None = None
    sampling_defaults: dict[str, float | int] | None = None


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
