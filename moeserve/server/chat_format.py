"""Chat formats: how a conversation becomes prompt tokens, and how generated tokens become message fields.

Two formats, picked by the model's config.json `model_type` through a table (callers never branch on model type):
- `TemplateChat`: the model's jinja chat template, rendered as transformers renders it; output text is content.
- `HarmonyChat` (gpt-oss): openai-harmony renders the conversation and splits the output into reasoning
  (analysis channel), content (final channel) and tool calls.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moeserve.errors import RequestError
from moeserve.server.harmony import HarmonyOutputParser, build_conversation, load_encoding, vocab_folder
from moeserve.server.protocol import ChatCompletionRequest, ChatMessage
from moeserve.server.streaming import Delta


@dataclass
class ChatPrompt:
    token_ids: list[int]
    text: str | None = None


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""


class OutputParser(ABC):
    """Per-choice state that turns output deltas into message fields."""

    @abstractmethod
    def feed(self, delta: Delta) -> ChatDelta:
        """Reasoning and content gained with this delta."""

    def flush(self) -> ChatDelta:
        """What is left to return once the output has finished (called once, before tool_calls)."""
        return ChatDelta()

    def tool_calls(self) -> list[tuple[str, str]]:
        """(function name, arguments) of the tool calls in the whole output; call once it finished."""
        return []

    def has_content(self) -> bool:
        """Whether the model produced an answer (so content must not be null)."""
        return True

    def cut_in_reasoning(self) -> bool:
        """Whether generation stopped inside the reasoning (then no final answer exists)."""
        return False


class ChatFormat(ABC):
    name: str

    @abstractmethod
    def render(self, req: ChatCompletionRequest | list[ChatMessage], add_generation_prompt: bool = True
               ) -> ChatPrompt:
        """The prompt for a conversation. Raises RequestError (400) for conversations the format rejects."""

    def stop_token_ids(self) -> list[int]:
        """Extra token ids that end the assistant's turn."""
        return []

    @abstractmethod
    def new_parser(self) -> OutputParser: ...


# -------------------------------------------------------------------------------------------- jinja template
class _TextParser(OutputParser):
    def feed(self, delta: Delta) -> ChatDelta:
        return ChatDelta(content=delta.text)


def _template_message(m: ChatMessage) -> dict[str, Any]:
    message = m.model_dump(exclude_none=True)
    message["content"] = m.text()  # templates expect a string; null and content parts are normalised
    return message


class TemplateChat(ChatFormat):
    name = "jinja chat template"

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def render(self, req: ChatCompletionRequest | list[ChatMessage], add_generation_prompt: bool = True
               ) -> ChatPrompt:
        if self.tokenizer is None:
            raise RequestError("chat needs a tokenizer (the server runs with skip_tokenizer_init)", param="messages")
        messages = req.messages if isinstance(req, ChatCompletionRequest) else req
        kwargs: dict[str, Any] = {}
        tools = None
        if isinstance(req, ChatCompletionRequest):
            add_generation_prompt = req.add_generation_prompt
            kwargs = dict(req.chat_template_kwargs or {})
            tools = req.tools
        try:
            text = self.tokenizer.apply_chat_template([_template_message(m) for m in messages],
                                                      add_generation_prompt=add_generation_prompt, tools=tools,
                                                      **kwargs)
        except RequestError:
            raise
        except Exception as err:  # a template that fails on this input (TypeError ...) is a bad request
            raise RequestError(f"chat template error: {type(err).__name__}: {err}", param="messages") from None
        # The rendered text already holds the special tokens: do not add BOS again.
        return ChatPrompt(self.tokenizer.encode(text, add_special_tokens=False), text)

    def new_parser(self) -> OutputParser:
        return _TextParser()


# ---------------------------------------------------------------------------------------------------- harmony
class _HarmonyParser(OutputParser):
    def __init__(self, encoding: Any) -> None:
        self.inner = HarmonyOutputParser(encoding)

    def feed(self, delta: Delta) -> ChatDelta:
        d = self.inner.feed(delta.token_ids)
        return ChatDelta(reasoning=d.reasoning, content=d.content)

    def flush(self) -> ChatDelta:
        d = self.inner.flush()
        return ChatDelta(reasoning=d.reasoning, content=d.content)

    def tool_calls(self) -> list[tuple[str, str]]:
        return self.inner.finish()

    def has_content(self) -> bool:
        return self.inner.saw_final or self.inner.broken

    def cut_in_reasoning(self) -> bool:
        return self.inner.channel in ("analysis", "commentary") and not self.inner.saw_final


class HarmonyChat(ChatFormat):
    name = "harmony (openai-harmony)"

    def __init__(self, model_folder: Path | None) -> None:
        self.vocab_folder = vocab_folder(model_folder)
        self.encoding = load_encoding(str(self.vocab_folder))

    def render(self, req: ChatCompletionRequest | list[ChatMessage], add_generation_prompt: bool = True
               ) -> ChatPrompt:
        from openai_harmony import Role

        if isinstance(req, ChatCompletionRequest):
            conversation = build_conversation(req.messages, req.tools, req.reasoning_effort)
        else:
            conversation = build_conversation(req)
        ids = list(self.encoding.render_conversation_for_completion(conversation, Role.ASSISTANT))
        return ChatPrompt(ids, None)

    def stop_token_ids(self) -> list[int]:
        return list(self.encoding.stop_tokens_for_assistant_actions())

    def new_parser(self) -> OutputParser:
        return _HarmonyParser(self.encoding)


# model_type (config.json) -> chat format; anything else uses the model's jinja template.
CHAT_FORMATS: dict[str, Callable[[Any, Path | None], ChatFormat]] = {
    "gpt_oss": lambda tokenizer, folder: HarmonyChat(folder),
}


def chat_format_for(model_type: str | None, tokenizer: Any, model_folder: Path | None) -> ChatFormat:
    make = CHAT_FORMATS.get(model_type or "")
    return make(tokenizer, model_folder) if make is not None else TemplateChat(tokenizer)
