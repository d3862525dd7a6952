"""`<think>...</think>` reasoning (Qwen3, Qwen3.5, DeepSeek-R1 style), split from the answer as text streams in.

Streaming-safe: text that may be the start of a tag is held back until the next piece says whether it is one, so
no partial tag reaches either field, and feeding the text in any pieces gives the same fields as feeding it whole.
Newlines next to a tag are layout, not text (Qwen3's template strips them when it renders the turn back): the
newlines that open a section are dropped, and those that close the reasoning are held back and dropped at
`</think>`.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (what must wait for more text)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def opens_reasoning(prompt_text: str) -> bool:
    """Whether a rendered prompt leaves a `<think>` open, so the output starts inside the reasoning (templates of
    DeepSeek-R1, Qwen3-thinking and Qwen3.5 put `<think>` in the generation prompt)."""
    return prompt_text.rfind(THINK_OPEN) > prompt_text.rfind(THINK_CLOSE)


def template_has_think_tags(template: str) -> bool:
    return THINK_OPEN in template and THINK_CLOSE in template


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""


class ThinkTagSplitter:
    """Feeds of generated text -> reasoning (inside `<think>...</think>`) and content (outside)."""

    def __init__(self, starts_in_reasoning: bool) -> None:
        self.in_reasoning = starts_in_reasoning
        self._pending = ""  # text not classified yet: a possible partial tag, or newlines before </think>
        self._section_start = True  # nothing shown yet in the current section: leading newlines are dropped

    def feed(self, text: str) -> Split:
        out = Split()
        self._pending += text
        while True:
            tag = THINK_CLOSE if self.in_reasoning else THINK_OPEN
            at = self._pending.find(tag)
            if at < 0:
                break
            before = self._pending[:at]
            self._emit(before.rstrip("\n") if self.in_reasoning else before, out)
            self._pending = self._pending[at + len(tag):]
            self.in_reasoning = not self.in_reasoning
            self._section_start = True
        tag = THINK_CLOSE if self.in_reasoning else THINK_OPEN
        keep = partial_tag_len(self._pending, tag)
        ready = self._pending[:len(self._pending) - keep]
        if self.in_reasoning:  # newlines right before </think> are layout: wait to see what follows them
            stripped = ready.rstrip("\n")
            keep += len(ready) - len(stripped)
            ready = stripped
        self._emit(ready, out)
        self._pending = self._pending[len(self._pending) - keep:] if keep else ""
        return out

    def flush(self) -> Split:
        """At the end of the output: what was held back belongs to the current section after all."""
        out = Split()
        self._emit(self._pending, out)
        self._pending = ""
        return out

    def _emit(self, text: str, out: Split) -> None:
        if self._section_start:
            text = text.lstrip("\n")
        if not text:
            return
        self._section_start = False
        if self.in_reasoning:
            out.reasoning += text
        else:
            out.content += text
