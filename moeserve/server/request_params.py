"""OpenAI request fields -> engine SamplingParams, with the checks that must answer 400 before queueing."""

from __future__ import annotations

from moeserve.engine.logits_processor import Constraint
from moeserve.engine.sampling_params import SamplingParams
from moeserve.server.errors import APIError
from moeserve.server.protocol import SamplingFields

# Temperatures below this are greedy (as in vLLM): dividing logits by a subnormal number overflows to inf/nan.
GREEDY_BELOW_TEMPERATURE = 1e-5


def check_context(prompt_tokens: int, max_tokens: int | None, max_model_len: int, default: int | None = None,
                  param: str = "messages") -> int:
    """The number of tokens to generate: `max_tokens`; when it is None, all the context left, or `default` (the
    model's max_new_tokens, ServerState.default_max_tokens) when that is less, as vLLM does. `param`: the field that
    holds the prompt ("messages", "prompt"), named by the error.

    Raises a 400 with OpenAI's wording (which clients parse to trim history) when the prompt plus the completion
    do not fit in the context."""
    if prompt_tokens >= max_model_len:
        raise APIError(
            400, f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
            f"{prompt_tokens} tokens, which leaves no room for a completion. Please reduce the length of the "
            "prompt.", param=param, code="context_length_exceeded")
    if max_tokens is None:
        return min(max_model_len - prompt_tokens, default or max_model_len)
    if prompt_tokens + max_tokens > max_model_len:
        raise APIError(
            400, f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {param}, {max_tokens} in the "
            f"completion). Please reduce the length of the {param} or completion.",
            param="max_tokens", code="context_length_exceeded")
    return max_tokens


def _stop_strings(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


def sampling_params(req: SamplingFields, max_tokens: int, max_num_seqs: int, logprobs: int | None,
                    extra_stop_token_ids: list[int] | None = None, extra_stop: list[str] | None = None,
                    constraint: Constraint | None = None) -> SamplingParams:
    """Build SamplingParams; unset fields take vLLM's defaults (temperature 1, top_p 1, no top_k). The extra
    stops are the chat format's (end of turn, end of a tool call); `constraint`: the compiled structured output."""
    if req.n > max_num_seqs:
        raise APIError(400, f"n={req.n} is more than this server decodes at once (max_num_seqs={max_num_seqs})",
                       param="n")
    stop_ids = list(req.stop_token_ids or []) + list(extra_stop_token_ids or [])
    temperature = 1.0 if req.temperature is None else req.temperature
    return SamplingParams(
        n=req.n,
        temperature=0.0 if temperature < GREEDY_BELOW_TEMPERATURE else temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k is None else req.top_k,
        min_p=0.0 if req.min_p is None else req.min_p,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        seed=req.seed,
        stop=[s for s in _stop_strings(req.stop) if s] + list(extra_stop or []),  # "" stops nothing: dropped
        stop_token_ids=stop_ids,
        ignore_eos=req.ignore_eos,
        max_tokens=max_tokens,
        min_tokens=min(req.min_tokens, max_tokens),
        logprobs=logprobs,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        constraint=constraint,
    )
