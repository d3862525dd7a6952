"""Which request fields moeserve honours, accepts without effect, or refuses: one table, checked before queueing.

Every field of OpenAI's chat and completions request schemas is known (protocol.py; anything else is a 400 with a
"did you mean"). Of those:
- honoured: model, messages, prompt, max_tokens, max_completion_tokens, temperature, top_p, n, seed, stop, stream,
  stream_options.include_usage, presence_penalty, frequency_penalty, logprobs, top_logprobs, tools, tool_choice,
  parallel_tool_calls, reasoning_effort (harmony; a template that reads it), best_of equal to n, response_format
  (structured.py); and vLLM's top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos, min_tokens,
  skip_special_tokens, include_stop_str_in_output, add_generation_prompt, chat_template_kwargs, structured_outputs,
  guided_json, guided_regex, guided_choice, guided_grammar, include_reasoning; SGLang's regex, ebnf, json_schema;
- accepted and ignored, because they cannot change the output: IGNORED below;
- refused when set to anything that would change the output, because moeserve cannot do it: REFUSALS below;
- written by vLLM's router into every request: accepted at their neutral value, refused otherwise (ROUTER_FIELDS).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from moeserve.errors import RequestError
from moeserve.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields, printable

# Accepted, with no effect on the output (documentation; the test suite checks each is a known field).
IGNORED = {
    "user": "an end-user id for abuse monitoring",
    "metadata": "tags for stored completions; nothing is stored",
    "store": "nothing is stored",
    "service_tier": "one tier",
    "prompt_cache_key": "prefix caching is automatic",
    "prompt_cache_retention": "prefix caching is automatic",
    "prompt_cache_options": "prefix caching is automatic",
    "safety_identifier": "an end-user id for abuse monitoring",
    "prediction": "predicted outputs only speed up OpenAI's decoding; the output is the same",
    "stream_options.include_obfuscation": "no padding is added",
    "tools[].function.strict": "the arguments follow the schema whenever tool_choice forces a call, strict or not",
    "messages[].refusal": "an earlier refusal is not rendered back",
}


def _set(value: Any) -> bool:
    return value is not None and value != [] and value != {}


# (field, request -> the value, is this value refused?, why); the message says what to do instead.
REFUSALS: list[tuple[str, Callable[[Any], Any], Callable[[Any], bool], str]] = [
    ("logit_bias", lambda r: r.logit_bias, _set, "is not supported"),
    ("stream_options", lambda r: r.stream_options and r.stream_options.continuous_usage_stats, bool,
     "continuous_usage_stats is not supported; include_usage gives the usage in a last chunk"),
    ("suffix", lambda r: getattr(r, "suffix", None), bool, "is not supported (no insertion mode)"),
    ("best_of", lambda r: getattr(r, "best_of", None), lambda v: v is not None, "must be unset or equal to n"),
    ("guided_decoding_backend", lambda r: r.guided_decoding_backend,
     lambda v: v is not None and v not in ("auto", "guidance", "llguidance"),
     "can only be 'guidance' (llguidance is the grammar engine here) or unset"),
    ("guided_whitespace_pattern", lambda r: r.guided_whitespace_pattern, _set,
     "is not supported: JSON is generated on one line with ', ' and ': ' separators"),
    ("modalities", lambda r: getattr(r, "modalities", None), lambda v: v is not None and bool(set(v) - {"text"}),
     "only ['text'] is supported"),
    ("audio", lambda r: getattr(r, "audio", None), _set, "audio output is not supported"),
    ("web_search_options", lambda r: getattr(r, "web_search_options", None), _set, "web search is not supported"),
    ("verbosity", lambda r: getattr(r, "verbosity", None), _set,
     "is not supported (no model served here reads it); say it in the system message"),
    ("moderation", lambda r: getattr(r, "moderation", None), _set, "is not supported"),
    ("functions", lambda r: getattr(r, "functions", None), _set, "is deprecated and not supported; use tools"),
    ("function_call", lambda r: getattr(r, "function_call", None), _set,
     "is deprecated and not supported; use tool_choice"),
]


# vLLM's router (vllm-router) writes these vLLM/SGLang fields into every request it forwards, at the neutral value
# given here (the one that asks for what moeserve does anyway); any other value is refused, naming it:
# (field, neutral value, why another value is refused). The router's ignore_eos and skip_special_tokens are
# honoured, as are include_reasoning (chat.py) and regex, ebnf, json_schema (structured.py); session_params: below.
ROUTER_FIELDS: list[tuple[str, Any, str]] = [
    ("no_stop_trim", False, "is not supported: a matched stop string is cut from the text "
     "(include_stop_str_in_output: true keeps it) and a stop token is never in it"),
    ("return_hidden_states", False, "is not supported: hidden states are not returned"),
    ("lora_path", None, "is not supported: no LoRA adapters are served"),
    ("echo", False, "is not supported: the prompt is not echoed back"),
    ("continue_final_message", False, "is not supported: every message is rendered as a finished turn"),
    ("separate_reasoning", True, "is not supported: reasoning always comes in its own field, apart from content"),
    ("stream_reasoning", True, "is not supported: reasoning is streamed as it is generated"),
]
SESSION_ROUTING_KEY = "session_id"  # vllm-router's session affinity key; it changes nothing in the output


def _router_fields(req: SamplingFields) -> None:
    for name, neutral, why in ROUTER_FIELDS:
        value = getattr(req, name, neutral)
        if value != neutral:
            shown = printable(json.dumps(value, default=str))
            raise RequestError(f"{name}={shown} {why}", param=name)
    for key in req.session_params or {}:
        if key != SESSION_ROUTING_KEY:
            raise RequestError(f"session_params.{printable(str(key))} is not supported (SGLang's session control); "
                               f"only session_params.{SESSION_ROUTING_KEY}, a routing key, is accepted",
                               param="session_params")


def check_ranges(req: SamplingFields, vocab_size: int | None) -> None:
    """Raise RequestError (400) naming the field, its value and the rule, for values that are each valid alone but
    not together (min_tokens above max_tokens would run silently to `length`) or not for this model (top_k beyond
    the vocabulary)."""
    limit_name = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
    limit = getattr(req, limit_name)
    if limit is not None and req.min_tokens > limit:
        raise RequestError(f"min_tokens is {req.min_tokens} but {limit_name} is {limit}: min_tokens must be at most "
                           f"{limit_name}", param="min_tokens")
    if vocab_size is not None and req.top_k is not None and req.top_k > vocab_size:
        raise RequestError(f"top_k is {req.top_k}: it must be -1, 0 (both: no top-k) or at most the vocabulary "
                           f"size, {vocab_size}", param="top_k")


def check_request_fields(req: SamplingFields) -> None:
    """Raise RequestError (400) for a field set to something moeserve cannot honour."""
    for name, get, refused, why in REFUSALS:
        value = get(req)
        if name == "best_of" and isinstance(req, CompletionRequest) and value == req.n:
            continue
        if refused(value):
            raise RequestError(f"{name} {why}", param=name)
    if isinstance(req, ChatCompletionRequest):
        for i, m in enumerate(req.messages):
            if _set(m.audio) or _set(m.function_call):
                field = "audio" if _set(m.audio) else "function_call"
                raise RequestError(f"messages[{i}].{field} is not supported; use content and tool_calls",
                                   param="messages")
    _router_fields(req)
