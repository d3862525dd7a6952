"""Helpers shared by the generation endpoints: SSE framing, deltas from cumulative outputs, disconnect races."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel

from moeserve.engine.outputs import CompletionOutput, Logprob, RequestOutput

T = TypeVar("T")
SSE_DONE = "data: [DONE]\n\n"


def stream_chunk(object_name: str, request_id: str, created: int, model: str, choices: list[dict[str, Any]],
                 with_null_usage: bool) -> dict[str, Any]:
    """One streamed chunk body ("chat.completion.chunk" or "text_completion"); `usage: null` when the client
    asked for usage, which then comes in a final chunk with no choices."""
    chunk: dict[str, Any] = {"id": request_id, "object": object_name, "created": created, "model": model,
                             "choices": choices}
    if with_null_usage:
        chunk["usage"] = None
    return chunk


def sse(payload: BaseModel | dict[str, Any]) -> str:
    """One server-sent event holding `payload` as JSON."""
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body}\n\n"


class ClientGone(Exception):
    """The client closed the connection before the response was ready."""


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run `work`; if the client disconnects first, cancel it (which aborts its engine requests) and raise
    ClientGone. Streaming responses get the same from Starlette, which cancels the body iterator."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if task in done:
        return task.result()
    raise ClientGone()


@dataclass
class Delta:
    """What one choice gained since the previous output."""

    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass
class DeltaTracker:
    """Turns the engine's cumulative outputs into per-choice deltas (the engine never retracts shown text)."""

    text_len: dict[int, int] = field(default_factory=dict)
    num_tokens: dict[int, int] = field(default_factory=dict)

    def delta(self, comp: CompletionOutput) -> Delta:
        start_text = self.text_len.get(comp.index, 0)
        start_tok = self.num_tokens.get(comp.index, 0)
        self.text_len[comp.index] = max(start_text, len(comp.text))
        self.num_tokens[comp.index] = len(comp.token_ids)
        logprobs = comp.logprobs[start_tok:] if comp.logprobs is not None else None
        return Delta(comp.text[start_text:], comp.token_ids[start_tok:], logprobs, comp.finish_reason,
                     comp.stop_reason)


async def merge_streams(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as (stream index, output). Closing this closes (aborts) them all."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
            await queue.put((i, None))
        except Exception as err:  # handed to the consumer, which raises it
            await queue.put((i, err))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
