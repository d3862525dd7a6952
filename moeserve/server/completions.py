"""POST /v1/completions: one engine request per prompt, each with n samples; streamed (SSE) or not."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from moeserve.engine.outputs import Logprob, RequestOutput
from moeserve.errors import RequestError
from moeserve.server.errors import APIError, from_exception
from moeserve.server.metrics import RequestTimer
from moeserve.server.protocol import CompletionChoice, CompletionRequest, CompletionResponse, UsageInfo
from moeserve.server.request_params import check_context, sampling_params
from moeserve.server.state import ServerState
from moeserve.server.streaming import (
    SSE_DONE,
    DeltaTracker,
    cancel_on_disconnect,
    merge_streams,
    sse,
    stream_chunk,
)
from moeserve.server.structured import compile_constraint, grammar_spec


def completion_logprobs(logprobs: list[dict[int, Logprob]], token_ids: list[int], offset: int) -> dict[str, Any]:
    """The legacy completions logprobs object for these tokens; text offsets start at `offset`."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, logprobs):
        chosen = entry[token_id]
        text = chosen.decoded_token or ""
        tokens.append(text)
        token_logprobs.append(chosen.logprob)
        alternatives: dict[str, float] = {}
        for lp in sorted(entry.values(), key=lambda x: x.rank):  # tokens that decode alike keep the likeliest
            alternatives.setdefault(lp.decoded_token or "", lp.logprob)
        top.append(alternatives)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


async def _prompt_token_ids(req: CompletionRequest, state: ServerState) -> list[list[int]]:
    prompt = req.prompt
    if isinstance(prompt, str):
        prompts: list[str | list[int]] = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]  # type: ignore[arg-type]
    else:
        prompts = list(prompt)  # type: ignore[arg-type]
    if len(prompts) > 64:
        raise APIError(400, "at most 64 prompts per request", param="prompt")
    out: list[list[int]] = []
    for p in prompts:
        if not isinstance(p, str):
            out.append(list(p))
            continue
        if state.tokenizer is None:
            raise APIError(400, "text prompts need a tokenizer; send token ids", param="prompt")
        state.check_text_fits(p, "prompt")  # before seconds of tokenizing a text that cannot fit
        out.append(list(await state.off_loop(state.tokenizer.encode, p)))  # off the event loop: a long text takes s
    return out


async def create_completion(req: CompletionRequest, raw: Request, state: ServerState) -> Response:
    state.accept(req.model, req)
    prompts = await _prompt_token_ids(req, state)
    try:
        spec = grammar_spec(req)
    except RequestError as err:  # as an APIError: the catch-all handler would also close the connection
        raise from_exception(err) from None
    constraint = await compile_constraint(state.llm, spec)
    params = []
    for ids in prompts:
        max_tokens = check_context(len(ids), req.max_tokens, state.max_model_len, state.default_max_tokens(),
                                   param="prompt")
        state.validate_prompt(ids)
        params.append(sampling_params(req, max_tokens, state.max_num_seqs, req.logprobs, constraint=constraint))
    request_id = f"cmpl-{uuid.uuid4().hex}"
    timer = state.metrics.request_timer()
    streams = []
    try:
        for i, (ids, p) in enumerate(zip(prompts, params)):
            streams.append(state.engine.submit(ids, p, f"{request_id}-{i}"))
    except Exception as err:
        for i in range(len(streams)):
            state.engine.abort(f"{request_id}-{i}")
        state.metrics.rejected.inc(1, type(err).__name__)
        raise from_exception(err) from None
    job = _Completion(req, state, request_id, prompts, timer)
    if req.stream:
        return StreamingResponse(job.stream(merge_streams(streams)), media_type="text/event-stream")
    result = await cancel_on_disconnect(raw, job.collect(merge_streams(streams)))
    return JSONResponse(result.model_dump())


class _Completion:
    def __init__(self, req: CompletionRequest, state: ServerState, request_id: str, prompts: list[list[int]],
                 timer: RequestTimer) -> None:
        self.req, self.state, self.request_id, self.prompts, self.timer = req, state, request_id, prompts, timer
        self.created = int(time.time())
        self.n = req.n

    def _usage(self, finals: dict[int, RequestOutput]) -> UsageInfo:
        prompt_tokens = sum(len(p) for p in self.prompts)
        completion_tokens = sum(len(c.token_ids) for out in finals.values() for c in out.outputs)
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=prompt_tokens + completion_tokens)

    def _finish(self, finals: dict[int, RequestOutput]) -> UsageInfo:
        usage = self._usage(finals)
        self.timer.finish(usage.prompt_tokens, usage.completion_tokens,
                          [c.finish_reason for out in finals.values() for c in out.outputs])
        return usage

    async def collect(self, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> CompletionResponse:
        finals: dict[int, RequestOutput] = {}
        seen: dict[int, int] = {}
        async for i, out in outputs:
            total = sum(len(c.token_ids) for c in out.outputs)
            self.timer.on_tokens(total - seen.get(i, 0))
            seen[i] = total
            finals[i] = out
        choices = []
        for i, out in sorted(finals.items()):
            for comp in out.outputs:
                logprobs = None
                if self.req.logprobs is not None and comp.logprobs is not None:
                    logprobs = completion_logprobs(comp.logprobs, comp.token_ids, 0)
                choices.append(CompletionChoice(index=i * self.n + comp.index, text=comp.text, logprobs=logprobs,
                                                finish_reason=comp.finish_reason, stop_reason=comp.stop_reason))
        return CompletionResponse(id=self.request_id, created=self.created, model=self.state.model_name,
                                  choices=choices, usage=self._finish(finals))

    async def stream(self, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[str]:
        include_usage = bool(self.req.stream_options and self.req.stream_options.include_usage)
        trackers = [DeltaTracker() for _ in self.prompts]
        text_offsets: dict[tuple[int, int], int] = {}
        done: set[tuple[int, int]] = set()
        finals: dict[int, RequestOutput] = {}
        try:
            async for i, out in outputs:
                new_tokens = 0
                for comp in out.outputs:
                    key = (i, comp.index)
                    if key in done:
                        continue
                    d = trackers[i].delta(comp)
                    new_tokens += len(d.token_ids)
                    if not d.text and not d.token_ids and d.finish_reason is None:
                        continue
                    logprobs = None
                    if self.req.logprobs is not None and d.logprobs is not None:
                        logprobs = completion_logprobs(d.logprobs, d.token_ids, text_offsets.get(key, 0))
                    text_offsets[key] = text_offsets.get(key, 0) + len(d.text)
                    if d.finish_reason is not None:
                        done.add(key)
                    choice = {"index": i * self.n + comp.index, "text": d.text, "logprobs": logprobs,
                              "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}
                    yield sse(self._chunk([choice], include_usage))
                self.timer.on_tokens(new_tokens)
                if out.finished:
                    finals[i] = out
            usage = self._finish(finals)
            if include_usage:
                yield sse({**self._chunk([], False), "usage": usage.model_dump()})
        except Exception as err:  # the status line is already sent: report in the stream (as vLLM does)
            yield sse(from_exception(err).body())
        yield SSE_DONE

    def _chunk(self, choices: list[dict[str, Any]], with_null_usage: bool) -> dict[str, Any]:
        return stream_chunk("text_completion", self.request_id, self.created, self.state.model_name, choices,
                            with_null_usage)
