"""One choice's output as a sequence of blocks (reasoning, text, tool call), each started, grown and stopped as the
engine streams it: what the Responses API calls output items and the Messages API content blocks. Both endpoints
read the output through here, parsed by the same chat-format parsers as /v1/chat/completions.

A new kind of output closes the open block and starts another (reasoning, then text, then calls, in the order the
model wrote them); each tool call is its own block. Whitespace with no text block open is held back until text
follows, and dropped if none does (the newlines a template puts around a call are layout, not an answer).
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any, Literal

from moeserve.server.chat import StartedChat
from moeserve.server.chat_format import ChatDelta
from moeserve.server.streaming import DeltaTracker

BlockKind = Literal["reasoning", "text", "call"]


@dataclass
class Block:
    kind: BlockKind
    index: int  # position among the output's blocks
    text: str = ""  # the reasoning, the text, or a call's arguments (JSON text)
    call_id: str = ""
    name: str = ""

    def arguments(self) -> dict[str, Any]:
        """A call's arguments as an object ({} when the model wrote none; kept as text under "" when not JSON)."""
        try:
            value = json.loads(self.text or "{}")
        except ValueError:
            return {"": self.text}
        return value if isinstance(value, dict) else {"": self.text}


@dataclass
class BlockEvent:
    action: Literal["start", "delta", "stop"]
    block: Block
    delta: str = ""
    cut: bool = False  # a stop because the output reached its token limit (the block is incomplete)


@dataclass
class Finish:
    """How the output ended, and its token counts."""

    finish_reason: str | None  # the engine's: "stop" or "length"
    stop_reason: int | str | None  # the stop string or token that ended it
    prompt_tokens: int
    completion_tokens: int
    blocks: list[Block] = field(default_factory=list)

    @property
    def has_calls(self) -> bool:
        return any(b.kind == "call" for b in self.blocks)


class BlockSequencer:
    """ChatDeltas (with tool-call deltas in chat's streamed shape) -> BlockEvents."""

    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self.open: Block | None = None
        self.calls: dict[int, Block] = {}  # tool-call index -> its block
        self._space = ""  # whitespace held back while no text block is open

    def feed(self, reasoning: str, content: str, calls: list[dict[str, Any]]) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        if reasoning:
            events += self._grow("reasoning", reasoning)
        if content:
            if (self.open is None or self.open.kind != "text") and not content.strip():
                self._space, content = self._space + content, ""
            elif self.open is None or self.open.kind != "text":
                content, self._space = self._space + content, ""
            if content:
                events += self._grow("text", content)
        for call in calls:
            block = self.calls.get(call["index"])
            if block is None:
                events += self._start("call", call_id=call["id"], name=call["function"]["name"])
                block = self.calls[call["index"]] = self.blocks[-1]
            arguments = call["function"].get("arguments") or ""
            if arguments:
                block.text += arguments
                events.append(BlockEvent("delta", block, arguments))
        return events

    def close(self, cut: bool = False) -> list[BlockEvent]:
        """Stop the open block (at the end of the output: `cut` when the token limit ended it)."""
        if self.open is None:
            return []
        block, self.open = self.open, None
        return [BlockEvent("stop", block, cut=cut)]

    def _start(self, kind: BlockKind, **fields: Any) -> list[BlockEvent]:
        events = self.close()
        self.open = Block(kind, len(self.blocks), **fields)
        self.blocks.append(self.open)
        return events + [BlockEvent("start", self.open)]

    def _grow(self, kind: BlockKind, text: str) -> list[BlockEvent]:
        events = [] if self.open is not None and self.open.kind == kind else self._start(kind)
        assert self.open is not None
        self.open.text += text
        return events + [BlockEvent("delta", self.open, text)]


async def output_blocks(started: StartedChat) -> AsyncGenerator[BlockEvent | Finish, None]:
    """The events of a started chat request's one choice, then its Finish. Closing this aborts the request."""
    choice = started.choices[0]
    tracker, sequencer = DeltaTracker(), BlockSequencer()
    finish: tuple[str | None, int | str | None, int] = (None, None, 0)
    try:
        async for out in started.stream:
            comp = out.outputs[0]
            d = tracker.delta(comp)
            started.timer.on_tokens(len(d.token_ids))
            parsed: ChatDelta = choice.parser.feed(d)
            if d.finish_reason is not None:
                parsed.extend(choice.parser.flush())
            for event in sequencer.feed(parsed.reasoning, parsed.content, choice.tool_call_deltas(parsed.tool_calls)):
                yield event
            finish = (comp.finish_reason, comp.stop_reason, len(comp.token_ids))
    finally:
        close = getattr(started.stream, "aclose", None)
        if close is not None:
            await close()
    for event in sequencer.close(cut=finish[0] == "length"):
        yield event
    started.timer.finish(started.prompt_tokens, finish[2], [finish[0]])
    yield Finish(finish[0], finish[1], started.prompt_tokens, finish[2], sequencer.blocks)
