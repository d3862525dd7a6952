"""POST /v1/chat/completions: render the conversation with the model's chat format, generate, split the output
into reasoning / content / tool calls; streamed (SSE) or not."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from moeserve.engine.outputs import Logprob, RequestOutput
from moeserve.errors import RequestError
from moeserve.server.chat_format import ChatDelta, OutputParser
from moeserve.server.errors import from_exception
from moeserve.server.metrics import RequestTimer
from moeserve.server.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ResponseMessage,
    ResponseToolCall,
    UsageInfo,
)
from moeserve.server.request_params import check_context, sampling_params
from moeserve.server.state import ServerState
from moeserve.server.streaming import SSE_DONE, Delta, DeltaTracker, cancel_on_disconnect, sse, stream_chunk
from moeserve.server.structured import compile_constraint
from moeserve.server.tool_parsers import ToolCallDelta


def _token_entry(lp: Logprob) -> dict[str, Any]:
    text = lp.decoded_token or ""
    return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(logprobs: list[dict[int, Logprob]], token_ids: list[int], top_k: int) -> dict[str, Any]:
    """The chat logprobs object: per token its logprob and the top_k alternatives."""
    content = []
    for token_id, entry in zip(token_ids, logprobs):
        top = sorted((lp for lp in entry.values() if lp.rank <= top_k), key=lambda lp: lp.rank)[:top_k]
        content.append({**_token_entry(entry[token_id]), "top_logprobs": [_token_entry(lp) for lp in top]})
    return {"content": content}


def _finish_reason(reason: str | None, has_calls: bool) -> str | None:
    # A max_tokens cut inside the reasoning is "length" too; the message then has reasoning and content null.
    if reason == "stop" and has_calls:
        return "tool_calls"
    return reason


class _Choice:
    """One choice's parser and the ids given to its tool calls (ids are the server's, as OpenAI's are). Without
    `include_reasoning` (vLLM's field) the reasoning is parsed out and left out of the answer."""

    def __init__(self, parser: OutputParser, parallel: bool, include_reasoning: bool = True) -> None:
        self.parser, self.parallel, self.include_reasoning = parser, parallel, include_reasoning
        self.ids: dict[int, str] = {}

    def tool_call_deltas(self, calls: list[ToolCallDelta]) -> list[dict[str, Any]]:
        """Tool-call deltas in the streamed shape: the first of each call has its id, type and name; those of one
        call in a row are merged. Without parallel calls only the first call is kept."""
        out: list[dict[str, Any]] = []
        for call in calls:
            if not self.parallel and call.index > 0:
                continue
            if out and out[-1]["index"] == call.index:
                out[-1]["function"]["arguments"] += call.arguments
            elif call.index not in self.ids:
                self.ids[call.index] = call.call_id or f"call_{uuid.uuid4().hex[:24]}"  # the format's own id first
                out.append({"index": call.index, "id": self.ids[call.index], "type": "function",
                            "function": {"name": call.name or "", "arguments": call.arguments}})
            else:
                out.append({"index": call.index, "function": {"arguments": call.arguments}})
        return out

    def message(self, d: ChatDelta) -> ResponseMessage:
        """The whole output as a message: content null only when there is no answer but reasoning or calls."""
        calls = [ResponseToolCall(id=c["id"], function=c["function"]) for c in self.tool_call_deltas(d.tool_calls)]
        content = d.content if self.parser.has_content() or not (d.reasoning or calls) else None
        reasoning = (d.reasoning or None) if self.include_reasoning else None
        return ResponseMessage(content=content, reasoning=reasoning, reasoning_content=reasoning, tool_calls=calls)


@dataclass
class StartedChat:
    """A chat request handed to the engine: its rendered prompt, its output stream and one parser per choice."""

    request_id: str
    prompt_tokens: int
    stream: AsyncIterator[RequestOutput]
    choices: list[_Choice]
    timer: RequestTimer


async def start_chat(req: ChatCompletionRequest, state: ServerState, request_id: str) -> StartedChat:
    """Render `req` with the model's chat format, check it, and submit it to the engine (every generation endpoint
    that speaks in messages goes through here: chat completions, responses, messages). Raises APIError."""
    state.accept(req.model, req)
    chat_format = state.chat_format()
    try:
        prompt = await state.off_loop(chat_format.render, req)  # off the event loop: a long prompt takes seconds
    except RequestError as err:  # as an APIError: the catch-all handler would also close the connection
        raise from_exception(err) from None
    max_tokens = check_context(len(prompt.token_ids), req.max_completion_tokens or req.max_tokens,
                               state.max_model_len, state.default_max_tokens())
    state.validate_prompt(prompt.token_ids)
    top_k = req.top_logprobs or 0
    constraint = await compile_constraint(state.llm, prompt.grammar, chat_format.grammar_compiler(state.llm))
    params = sampling_params(req, max_tokens, state.max_num_seqs, top_k if req.logprobs else None,
                             chat_format.stop_token_ids(), prompt.stop, constraint)
    if prompt.keep_special_tokens:
        params = dataclasses.replace(params, skip_special_tokens=False)
    timer = state.metrics.request_timer()
    try:
        stream = state.engine.submit(prompt.token_ids, params, request_id)
    except Exception as err:
        state.metrics.rejected.inc(1, type(err).__name__)
        raise from_exception(err) from None
    parallel = req.parallel_tool_calls is not False
    choices = [_Choice(chat_format.new_parser(prompt), parallel, req.include_reasoning) for _ in range(req.n)]
    return StartedChat(request_id, len(prompt.token_ids), stream, choices, timer)


async def create_chat_completion(req: ChatCompletionRequest, raw: Request, state: ServerState) -> Response:
    started = await start_chat(req, state, f"chatcmpl-{uuid.uuid4().hex}")
    job = _Chat(req, state, started.request_id, started.prompt_tokens, started.timer, started.choices)
    if req.stream:
        return StreamingResponse(job.stream(started.stream), media_type="text/event-stream")
    result = await cancel_on_disconnect(raw, job.collect(started.stream))
    return JSONResponse(result.model_dump())


class _Chat:
    def __init__(self, req: ChatCompletionRequest, state: ServerState, request_id: str, prompt_tokens: int,
                 timer: RequestTimer, choices: list[_Choice]) -> None:
        self.req, self.state, self.request_id = req, state, request_id
        self.prompt_tokens, self.timer = prompt_tokens, timer
        self.created = int(time.time())
        self.choices = choices
        self.top_k = req.top_logprobs or 0

    def _finish(self, final: RequestOutput | None) -> UsageInfo:
        comps = final.outputs if final is not None else []
        completion_tokens = sum(len(c.token_ids) for c in comps)
        self.timer.finish(self.prompt_tokens, completion_tokens, [c.finish_reason for c in comps])
        return UsageInfo(prompt_tokens=self.prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=self.prompt_tokens + completion_tokens)

    async def collect(self, stream: AsyncIterator[RequestOutput]) -> ChatCompletionResponse:
        final: RequestOutput | None = None
        seen = 0
        async for out in stream:
            total = sum(len(c.token_ids) for c in out.outputs)
            self.timer.on_tokens(total - seen)
            seen, final = total, out
        assert final is not None  # a stream ends with a finished output or raises
        tracker = DeltaTracker()
        choices = []
        for comp in final.outputs:
            choice = self.choices[comp.index]
            d = choice.parser.feed(tracker.delta(comp)).extend(choice.parser.flush())
            message = choice.message(d)
            logprobs = None
            if self.req.logprobs and comp.logprobs is not None:
                logprobs = chat_logprobs(comp.logprobs, comp.token_ids, self.top_k)
            choices.append(ChatChoice(index=comp.index, message=message, logprobs=logprobs,
                                      finish_reason=_finish_reason(comp.finish_reason, bool(message.tool_calls)),
                                      stop_reason=comp.stop_reason))
        return ChatCompletionResponse(id=self.request_id, created=self.created, model=self.state.model_name,
                                      choices=choices, usage=self._finish(final))

    async def stream(self, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
        include_usage = bool(self.req.stream_options and self.req.stream_options.include_usage)
        tracker = DeltaTracker()
        done: set[int] = set()
        final: RequestOutput | None = None
        try:
            for index in range(self.req.n):  # the first chunk of each choice names the role
                yield sse(self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}], include_usage))
            async for out in outputs:
                new_tokens = 0
                for comp in out.outputs:
                    if comp.index in done:
                        continue
                    d = tracker.delta(comp)
                    new_tokens += len(d.token_ids)
                    choice = self._stream_choice(comp.index, d)
                    if choice is not None:
                        yield sse(self._chunk([choice], include_usage))
                    if d.finish_reason is not None:
                        done.add(comp.index)
                self.timer.on_tokens(new_tokens)
                final = out
            usage = self._finish(final)
            if include_usage:
                yield sse({**self._chunk([], False), "usage": usage.model_dump()})
        except Exception as err:  # the status line is already sent: report in the stream (as vLLM does)
            yield sse(from_exception(err).body())
        yield SSE_DONE

    def _stream_choice(self, index: int, d: Delta) -> dict[str, Any] | None:
        """The streamed choice for one output delta, or None when it adds nothing yet (text held back)."""
        choice = self.choices[index]
        parsed = choice.parser.feed(d)
        if d.finish_reason is not None:
            parsed.extend(choice.parser.flush())
        delta: dict[str, Any] = {}
        if parsed.reasoning and choice.include_reasoning:
            delta["reasoning"] = delta["reasoning_content"] = parsed.reasoning
        if parsed.content:
            delta["content"] = parsed.content
        calls = choice.tool_call_deltas(parsed.tool_calls)
        if calls:
            delta["tool_calls"] = calls
        if d.finish_reason is None and not delta:
            return None
        logprobs = None
        if self.req.logprobs and d.logprobs is not None:
            logprobs = chat_logprobs(d.logprobs, d.token_ids, self.top_k)
        out: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}
        if d.finish_reason is not None:
            out["finish_reason"] = _finish_reason(d.finish_reason, bool(choice.ids))
            out["stop_reason"] = d.stop_reason
        return out

    def _chunk(self, choices: list[dict[str, Any]], with_null_usage: bool) -> dict[str, Any]:
        return stream_chunk("chat.completion.chunk", self.request_id, self.created, self.state.model_name, choices,
                            with_null_usage)
