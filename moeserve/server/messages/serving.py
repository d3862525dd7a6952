"""POST /v1/messages: the Anthropic Messages API on the chat path (convert.py -> chat.start_chat), its output read as
blocks (output_blocks.py) and written as content blocks: `thinking`, `text`, `tool_use`; streamed as Anthropic's
events (message_start, content_block_start / content_block_delta (thinking_delta, text_delta, input_json_delta) /
content_block_stop, message_delta with stop_reason and usage, message_stop). Errors take Anthropic's shape
(errors.py), also inside a stream (an `error` event). POST /v1/messages/count_tokens: the prompt's length."""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from moeserve.errors import RequestError
from moeserve.server.chat import start_chat
from moeserve.server.errors import from_exception
from moeserve.server.messages.convert import chat_request
from moeserve.server.messages.protocol import CountTokensRequest, MessagesRequest
from moeserve.server.output_blocks import Block, BlockEvent, Finish, output_blocks
from moeserve.server.state import ServerState
from moeserve.server.streaming import cancel_on_disconnect

DELTA_TYPES = {"reasoning": ("thinking_delta", "thinking"), "text": ("text_delta", "text"),
               "call": ("input_json_delta", "partial_json")}


async def create_message(req: MessagesRequest, raw: Request, state: ServerState) -> Response:
    state.accept(req.model)
    try:
        chat = chat_request(req, state.chat_format())
    except RequestError as err:
        raise from_exception(err) from None
    job = _Message(req, state, f"msg_{uuid.uuid4().hex}")
    started = await start_chat(chat, state, job.id)
    if req.stream:
        return StreamingResponse(job.stream(output_blocks(started), started.prompt_tokens),
                                 media_type="text/event-stream")
    body = await cancel_on_disconnect(raw, job.collect(output_blocks(started)))
    return JSONResponse(body)


async def count_tokens(req: CountTokensRequest, state: ServerState) -> dict[str, int]:
    """The prompt's length in tokens, rendered exactly as /v1/messages would render it."""
    state.accept(req.model)
    chat_format = state.chat_format()
    try:
        prompt = await state.off_loop(chat_format.render, chat_request(req.as_messages_request(), chat_format))
    except RequestError as err:
        raise from_exception(err) from None
    return {"input_tokens": len(prompt.token_ids)}


def content_block(block: Block, done: bool) -> dict[str, Any]:
    """A content block: whole when `done`, else as content_block_start announces it (empty)."""
    if block.kind == "reasoning":
        return {"type": "thinking", "thinking": block.text if done else "", "signature": ""}
    if block.kind == "text":
        return {"type": "text", "text": block.text if done else ""}
    return {"type": "tool_use", "id": block.call_id, "name": block.name, "input": block.arguments() if done else {}}


class _Message:
    def __init__(self, req: MessagesRequest, state: ServerState, message_id: str) -> None:
        self.req, self.state, self.id = req, state, message_id

    def stop(self, finish: Finish) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence)."""
        if finish.finish_reason == "length":
            return "max_tokens", None
        if finish.has_calls:
            return "tool_use", None
        if isinstance(finish.stop_reason, str) and finish.stop_reason in (self.req.stop_sequences or []):
            return "stop_sequence", finish.stop_reason
        return "end_turn", None

    def message(self, content: list[dict[str, Any]], finish: Finish | None, prompt_tokens: int) -> dict[str, Any]:
        stop_reason, stop_sequence = self.stop(finish) if finish is not None else (None, None)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.state.model_name,
                "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": {"input_tokens": prompt_tokens, "output_tokens": finish.completion_tokens if finish else 0,
                          "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}

    async def collect(self, events: AsyncIterator[BlockEvent | Finish]) -> dict[str, Any]:
        async for event in events:
            if isinstance(event, Finish):
                return self.message([content_block(b, True) for b in event.blocks], event, event.prompt_tokens)
        raise AssertionError("the output ended without a Finish")

    @staticmethod
    def event(kind: str, payload: dict[str, Any]) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, ensure_ascii=False)}\n\n"

    async def stream(self, events: AsyncGenerator[BlockEvent | Finish, None], prompt_tokens: int
                     ) -> AsyncIterator[str]:
        yield self.event("message_start", {"message": self.message([], None, prompt_tokens)})
        try:
            async with contextlib.aclosing(events):  # a client gone: the request is aborted at once
                async for event in events:
                    for line in self.stream_event(event):
                        yield line
        except Exception as err:  # the status line is already sent: report in the stream, as Anthropic does
            yield self.event("error", {"error": from_exception(err).anthropic_body()["error"]})

    def stream_event(self, event: BlockEvent | Finish) -> list[str]:
        if isinstance(event, Finish):
            stop_reason, stop_sequence = self.stop(event)
            return [self.event("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                                 "usage": {"output_tokens": event.completion_tokens}}),
                    self.event("message_stop", {})]
        index = event.block.index
        if event.action == "start":
            return [self.event("content_block_start", {"index": index,
                                                       "content_block": content_block(event.block, False)})]
        if event.action == "delta":
            kind, name = DELTA_TYPES[event.block.kind]
            return [self.event("content_block_delta", {"index": index, "delta": {"type": kind, name: event.delta}})]
        return [self.event("content_block_stop", {"index": index})]
