"""POST /v1/responses: the OpenAI Responses API on the chat path (convert.py -> chat.start_chat), its output read as
blocks (output_blocks.py) and written as output items: `reasoning`, `message` (output_text), `function_call`;
streamed as Responses events (response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.reasoning_text.delta / response.output_text.delta /
response.function_call_arguments.delta, their .done, response.output_item.done, then response.completed or
response.incomplete), each with its sequence_number."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from moeserve.errors import RequestError
from moeserve.server.chat import start_chat
from moeserve.server.errors import APIError, from_exception
from moeserve.server.output_blocks import Block, BlockEvent, Finish, output_blocks
from moeserve.server.protocol import ChatCompletionRequest, printable
from moeserve.server.responses.convert import chat_request, input_messages, output_message
from moeserve.server.responses.protocol import ResponsesRequest
from moeserve.server.responses.store import ResponseStore
from moeserve.server.state import ServerState
from moeserve.server.streaming import cancel_on_disconnect

ITEM_PREFIX = {"reasoning": "rs", "text": "msg", "call": "fc"}
# chat-completions fields -> the Responses fields they came from (for an error's `param`)
CHAT_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format",
               "reasoning_effort": "reasoning.effort", "tool_choice": "tool_choice", "tools": "tools"}


async def create_response(req: ResponsesRequest, raw: Request, state: ServerState, store: ResponseStore
                          ) -> Response:
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        found = store.get(req.previous_response_id)
        if found is None:
            raise APIError(400, f"Previous response with id {req.previous_response_id!r} not found (never stored, "
                           f"stored with store false, or evicted: this server keeps the last {store.max_count} "
                           "responses in memory)", param="previous_response_id", code="previous_response_not_found")
        history = list(found.messages)
    try:
        conversation = history + input_messages(req.input)
        chat = chat_request(req, conversation)
    except RequestError as err:
        raise from_exception(err) from None
    job = _Response(req, chat, state, f"resp_{uuid.uuid4().hex}", store, conversation)
    try:
        started = await start_chat(chat, state, job.id)
    except APIError as err:  # the chat request's field names -> this request's
        head, dot, rest = (err.param or "").partition(".")
        err.param = CHAT_PARAMS[head] + dot + rest if head in CHAT_PARAMS else err.param
        raise
    if req.stream:
        return StreamingResponse(job.stream(output_blocks(started)), media_type="text/event-stream")
    body = await cancel_on_disconnect(raw, job.collect(output_blocks(started)))
    return JSONResponse(body)


class _Response:
    def __init__(self, req: ResponsesRequest, chat: ChatCompletionRequest, state: ServerState, response_id: str,
                 store: ResponseStore, conversation: list[dict[str, Any]]) -> None:
        self.req, self.state, self.id, self.store = req, state, response_id, store
        self.chat = chat  # its unset sampling fields get the server's defaults when it starts (echoed as used)
        self.conversation = conversation
        self.created_at = int(time.time())
        self.item_ids: dict[int, str] = {}
        self.sequence_number = 0

    # ------------------------------------------------------------------------------------- the response object
    def body(self, status: str, output: list[dict[str, Any]], finish: Finish | None,
             error: dict[str, Any] | None = None) -> dict[str, Any]:
        req = self.req
        incomplete = finish is not None and finish.finish_reason == "length"
        usage = None
        if finish is not None:
            usage = {"input_tokens": finish.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                     "output_tokens": finish.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": finish.prompt_tokens + finish.completion_tokens}
        tool_choice: Any = req.tool_choice.model_dump() if req.tool_choice is not None and \
            not isinstance(req.tool_choice, str) else (req.tool_choice or "auto")
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": self.state.model_name, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
            "store": req.store, "temperature": 1.0 if self.chat.temperature is None else self.chat.temperature,
            "text": {"format": (req.text.format if req.text and req.text.format else {"type": "text"})},
            "tool_choice": tool_choice, "tools": req.tools or [],
            "top_p": 1.0 if self.chat.top_p is None else self.chat.top_p,
            "truncation": req.truncation or "disabled", "usage": usage, "user": req.user,
            "metadata": req.metadata or {},
        }

    def item(self, block: Block, status: str) -> dict[str, Any]:
        """The output item of a block (its text so far)."""
        item_id = self.item_ids.setdefault(block.index, f"{ITEM_PREFIX[block.kind]}_{uuid.uuid4().hex}")
        if block.kind == "reasoning":
            return {"id": item_id, "type": "reasoning", "summary": [],
                    "content": [{"type": "reasoning_text", "text": block.text}] if status != "in_progress" else [],
                    "encrypted_content": None, "status": status}
        if block.kind == "text":
            return {"id": item_id, "type": "message", "role": "assistant", "status": status,
                    "content": [self.part(block)] if status != "in_progress" else []}
        return {"id": item_id, "type": "function_call", "call_id": block.call_id, "name": block.name,
                "arguments": block.text, "status": status}

    @staticmethod
    def part(block: Block, text: str | None = None) -> dict[str, Any]:
        text = block.text if text is None else text
        if block.kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def final(self, finish: Finish) -> dict[str, Any]:
        """The finished response object; stored (with the conversation, for previous_response_id) unless store is
        false."""
        incomplete = finish.finish_reason == "length"
        items = [self.item(b, "incomplete" if incomplete and b is finish.blocks[-1] else "completed")
                 for b in finish.blocks]
        body = self.body(self.status(finish), items, finish)
        if self.req.store:
            reasoning = "".join(b.text for b in finish.blocks if b.kind == "reasoning")
            content = "".join(b.text for b in finish.blocks if b.kind == "text")
            calls = [(b.call_id, b.name, b.text) for b in finish.blocks if b.kind == "call"]
            self.store.put(self.id, self.conversation + [output_message(reasoning, content, calls)], body)
        return body

    @staticmethod
    def status(finish: Finish) -> str:
        return "incomplete" if finish.finish_reason == "length" else "completed"

    # ---------------------------------------------------------------------------------------------- serving
    async def collect(self, events: AsyncIterator[BlockEvent | Finish]) -> dict[str, Any]:
        async for event in events:
            if isinstance(event, Finish):
                return self.final(event)
        raise AssertionError("the output ended without a Finish")

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    async def stream(self, events: AsyncGenerator[BlockEvent | Finish, None]) -> AsyncIterator[str]:
        yield self.event("response.created", response=self.body("in_progress", [], None))
        yield self.event("response.in_progress", response=self.body("in_progress", [], None))
        try:
            async with contextlib.aclosing(events):  # a client gone: the request is aborted at once
                async for event in events:
                    if isinstance(event, Finish):
                        body = self.final(event)
                        yield self.event(f"response.{body['status']}", response=body)
                    else:
                        for line in self.block_events(event):
                            yield line
        except Exception as err:  # the status line is already sent: report in the stream
            api = from_exception(err)
            yield self.event("error", code=api.code or api.type, message=api.message, param=api.param)
            failed = self.body("failed", [], None, {"code": api.code or "server_error", "message": api.message})
            yield self.event("response.failed", response=failed)

    def block_events(self, event: BlockEvent) -> list[str]:
        block = event.block
        where = {"item_id": self.item(block, "in_progress")["id"], "output_index": block.index}
        if event.action == "start":
            out = [self.event("response.output_item.added", output_index=block.index,
                              item=self.item(block, "in_progress"))]
            if block.kind != "call":
                out.append(self.event("response.content_part.added", **where, content_index=0,
                                      part=self.part(block, "")))
            return out
        if event.action == "delta":
            if block.kind == "call":
                return [self.event("response.function_call_arguments.delta", **where, delta=event.delta)]
            if block.kind == "reasoning":
                return [self.event("response.reasoning_text.delta", **where, content_index=0, delta=event.delta)]
            return [self.event("response.output_text.delta", **where, content_index=0, delta=event.delta,
                               logprobs=[])]
        if block.kind == "call":
            out = [self.event("response.function_call_arguments.done", **where, name=block.name,
                              arguments=block.text)]
        else:
            done = "response.reasoning_text.done" if block.kind == "reasoning" else "response.output_text.done"
            extra: dict[str, Any] = {} if block.kind == "reasoning" else {"logprobs": []}
            out = [self.event(done, **where, content_index=0, text=block.text, **extra),
                   self.event("response.content_part.done", **where, content_index=0, part=self.part(block))]
        return out + [self.event("response.output_item.done", output_index=block.index,
                                 item=self.item(block, "incomplete" if event.cut else "completed"))]


def stored_response(response_id: str, store: ResponseStore) -> dict[str, Any]:
    """GET /v1/responses/{id}: a stored response object (404 when never stored or evicted)."""
    found = store.get(response_id)
    if found is None:
        raise _not_stored(response_id, store)
    return found.response


def delete_response(response_id: str, store: ResponseStore) -> dict[str, Any]:
    """DELETE /v1/responses/{id}."""
    if not store.delete(response_id):
        raise _not_stored(response_id, store)
    return {"id": response_id, "object": "response", "deleted": True}


def _not_stored(response_id: str, store: ResponseStore) -> APIError:
    return APIError(404, f"Response with id {printable(response_id)!r} not found (never stored, stored with store "
                    f"false, or evicted: this server keeps the last {store.max_count} responses in memory)",
                    param="response_id", code="not_found")
