"""Chat formats: how a conversation becomes prompt tokens, and how generated tokens become message fields.

Two formats, picked by the model's config.json `model_type` through a table (callers never branch on model type):
- `TemplateChat`: the model's jinja chat template, rendered as transformers renders it (tools, assistant tool
  calls and tool results included). Its output is split by what the template itself uses: `<think>` reasoning
  (reasoning.py) and a tool-call format (tool_parsers/).
- `HarmonyChat` (gpt-oss): openai-harmony renders the conversation and splits the output into reasoning
  (analysis channel), content (final channel) and tool calls (commentary channel to functions.NAME).
Both give an `OutputParser`: feeds of generated output -> `ChatDelta`s (reasoning, content, tool-call deltas).

tool_choice: "none" renders no tools and parses no calls; "auto" lets the model choose; "required" and a named
function append the start of a tool call to the prompt (the format's own opening, with the name when one is
named), so the output is a call (of that function); where the format has a call grammar (`ToolParser.call_grammar`,
harmony) the rest of that one call is constrained, its arguments to the function's parameters schema.
parallel_tool_calls=false stops the output at the end of the first call.

Structured output (response_format, guided_*: structured.py) constrains the answer. With a template that has
`<think>` tags the model may reason first: the grammar lets the reasoning run free up to its first `</think>` (opened
by the prompt, or optional), then holds the answer, or a forced call from its opening tag on, to the constraint.
Harmony's final channel is opened in the prompt (no analysis before a constrained answer).
"""

from __future__ import annotations

import difflib
import json
import logging
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from moeserve.engine.grammar import GrammarCompiler, GrammarSpec, SpecialTags, with_special_tokens
from moeserve.errors import RequestError
from moeserve.server.harmony import (
    VOCAB_FILE,
    HarmonyOutputParser,
    build_conversation,
    grammar_tokenizer,
    harmony_call_grammar,
    load_encoding,
    vocab_folder,
)
from moeserve.server.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice
from moeserve.server.reasoning import (
    THINK_CLOSE,
    THINK_OPEN,
    ThinkTagSplitter,
    opens_reasoning,
    template_has_think_tags,
)
from moeserve.server.streaming import Delta
from moeserve.server.structured import grammar_spec
from moeserve.server.tool_parsers import ToolCallDelta, ToolParser, tool_parser_for
from moeserve.template_limits import LimitedSandbox, RenderLimits

log = logging.getLogger("moeserve")


@dataclass
class ChatPrompt:
    token_ids: list[int]
    text: str | None = None
    tools: list[dict[str, Any]] | None = None  # the tools the output may call (none when tool_choice is "none")
    forced_text: str = ""  # the start of a tool call appended to the prompt: the output continues it
    forced_ids: list[int] = field(default_factory=list)  # the same, as tokens
    starts_in_reasoning: bool = False  # the prompt leaves <think> open
    stop: list[str] = field(default_factory=list)  # extra stop strings (the end of a call, without parallel calls)
    grammar: GrammarSpec | None = None  # what the output is constrained to (response_format, or a forced call)
    keep_special_tokens: bool = False  # decode the output with special tokens: the parsers' tags are among them


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def extend(self, other: ChatDelta) -> ChatDelta:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self


class OutputParser(ABC):
    """Per-choice state that turns output deltas into message fields."""

    @abstractmethod
    def feed(self, delta: Delta) -> ChatDelta:
        """Reasoning, content and tool-call deltas gained with this output delta."""

    def flush(self) -> ChatDelta:
        """What is left once the output has finished (called once): text held back, a call cut short."""
        return ChatDelta()

    def has_content(self) -> bool:
        """Whether the model produced an answer, even an empty one (then content is never null)."""
        return False


@dataclass
class ToolPlan:
    """What a request's tools and tool_choice mean for the prompt and the parser."""

    tools: list[dict[str, Any]] | None  # tools to render and parse calls of
    forced: bool = False  # tool_choice "required" or a named function
    function_name: str | None = None  # the named function
    parallel: bool = True

    @classmethod
    def of(cls, req: ChatCompletionRequest) -> ToolPlan:
        tools = req.tools or None
        defined = [t.function.name for t in req.checked_tools()]
        choice = req.tool_choice
        if choice not in (None, "none", "auto") and not tools:
            raise RequestError("tool_choice 'required' or a named function needs tools", param="tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in defined:
            close = difflib.get_close_matches(choice.function.name, defined, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise RequestError(f"tool_choice names {choice.function.name!r}, which is not in tools{hint}",
                               param="tool_choice")
        if choice == "none":
            return cls(None)
        if tools and grammar_spec(req) is not None:
            raise RequestError("an output constraint (response_format, guided_*) with tools would rule out tool "
                               "calls: set tool_choice 'none', or leave the constraint out", param="tool_choice")
        return cls(tools, forced=choice not in (None, "auto"),
                   function_name=choice.function.name if isinstance(choice, NamedToolChoice) else None,
                   parallel=req.parallel_tool_calls is not False)


class ChatFormat(ABC):
    name: str

    @abstractmethod
    def render(self, req: ChatCompletionRequest | list[ChatMessage], add_generation_prompt: bool = True
               ) -> ChatPrompt:
        """The prompt for a conversation. Raises RequestError (400) for requests the format rejects."""

    def stop_token_ids(self) -> list[int]:
        """Extra token ids that end the assistant's turn."""
        return []

    @abstractmethod
    def new_parser(self, prompt: ChatPrompt) -> OutputParser:
        """A parser for one output of `prompt` (it knows the prompt's tools and forced start)."""

    def grammar_compiler(self, llm: Any) -> Any:
        """What compiles this format's output constraints: the engine's (from its tokenizer), or None."""
        return getattr(llm, "grammar_compiler", None)

    def thinking_switch(self, enabled: bool) -> dict[str, Any] | None:
        """The chat_template_kwargs that turn the model's thinking on or off, or None when the format has no such
        switch (the Messages API's `thinking` parameter)."""
        return None


# -------------------------------------------------------------------------------------------- jinja template
class _TemplateParser(OutputParser):
    """Output text -> `<think>` reasoning (when the template has it) -> tool calls (when tools were given)."""

    def __init__(self, think: ThinkTagSplitter | None, tools: ToolParser | None, forced_text: str) -> None:
        self.think, self.tools = think, tools
        self._answered = False
        self._prefix = forced_text  # the prompt's forced start of a call: parsed as if generated

    def feed(self, delta: Delta) -> ChatDelta:
        text, self._prefix = self._prefix + delta.text, ""
        if self.think is None:
            return self._answer(ChatDelta(content=text))
        split = self.think.feed(text)
        return self._answer(ChatDelta(reasoning=split.reasoning, content=split.content))

    def flush(self) -> ChatDelta:
        out = ChatDelta()
        if self.think is not None:
            split = self.think.flush()
            out = ChatDelta(reasoning=split.reasoning, content=split.content)
        out = self._answer(out)
        if self.tools is not None:
            rest = self.tools.flush()
            out.content += rest.content
            out.tool_calls += rest.calls
        self._answered = self._answered or bool(out.content.strip())
        return out

    def _answer(self, d: ChatDelta) -> ChatDelta:
        if self.tools is not None and d.content:
            parsed = self.tools.feed(d.content)
            d.content, d.tool_calls = parsed.content, parsed.calls
        self._answered = self._answered or bool(d.content.strip())
        return d

    def has_content(self) -> bool:
        return self._answered


# Keyword arguments of apply_chat_template itself (and what the request sets): never chat_template_kwargs.
RESERVED_TEMPLATE_KWARGS = {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                            "tokenize", "return_dict", "chat_template"}


def template_variables(template: str | None) -> set[str] | None:
    """The names a jinja template reads from its context, or None when it cannot be parsed here."""
    if template is None:
        return None
    import jinja2
    import jinja2.ext
    from jinja2 import meta

    try:  # the sandbox that renders it: its `*` is never folded at compile time (a 2 GB constant would be built)
        env = LimitedSandbox(extensions=[jinja2.ext.loopcontrols])
        return set(meta.find_undeclared_variables(env.parse(template)))
    except jinja2.TemplateError:
        return None


def _template_message(m: ChatMessage, null_content: bool, arguments_as_text: bool) -> dict[str, Any]:
    """A message as the template reads it: content a string (parts joined; null stays null only for a template
    that tests for it, as DeepSeek's does), a call's arguments a mapping (transformers' convention, as vLLM passes
    them) or, for a template that concatenates them, the JSON text (checked to be an object)."""
    message = m.model_dump(exclude_none=True)
    message["content"] = None if null_content and m.content is None else m.text()
    if m.tool_calls:
        message["tool_calls"] = [
            {**call, "function": {**call["function"], "arguments": _arguments(call["function"]["arguments"],
                                                                              arguments_as_text)}}
            for call in message["tool_calls"]]
    return message


def _arguments(text: str, as_text: bool) -> Any:
    try:
        value = json.loads(text or "{}")
    except ValueError:
        raise RequestError(f"an assistant tool call's arguments are not JSON: {text[:80]!r}",
                           param="messages") from None
    if not isinstance(value, dict):
        raise RequestError("an assistant tool call's arguments must be a JSON object", param="messages")
    return (text or "{}") if as_text else value


_ENCODES_ARGUMENTS = re.compile(r"""arguments(?:'\]|"\])?\s*\|\s*tojson""")
_TESTS_NULL_CONTENT = re.compile(r"(\['content'\]|\.content) is (not )?none")
_TAKES_TEXT_ARGUMENTS = re.compile(r"""arguments(?:'\]|"\])?\s+is\s+string""")


class TemplateChat(ChatFormat):
    name = "jinja chat template"

    def __init__(self, tokenizer: Any, limits: RenderLimits | None = None) -> None:
        self.tokenizer = tokenizer
        self.limits = limits  # time and output size of one render (template_timeout_s, template_max_output_mb)
        template = getattr(tokenizer, "chat_template", None)
        self.template = template if isinstance(template, str) else None
        self.tool_parser = tool_parser_for(self.template)
        self.think = self.template is not None and template_has_think_tags(self.template)
        self.variables = template_variables(self.template)
        self.special_tags = self._special_tags()
        # a template that tells null content apart ("is none") gets it as null; others get ""
        self.null_content = self.template is not None and _TESTS_NULL_CONTENT.search(self.template) is not None
        # a format whose templates concatenate the arguments' text (DeepSeek-R1, Kimi-K2) gets text, unless this
        # template only encodes them itself (DeepSeek-V3.1: `arguments | tojson`, which would quote a text twice);
        # one that prints a text as it is (Kimi-K2: `arguments is string`) gets the text the model wrote
        template = self.template or ""
        self.arguments_as_text = (self.tool_parser is not None and self.tool_parser.template_arguments == "text"
                                  and (not _ENCODES_ARGUMENTS.search(template)
                                       or _TAKES_TEXT_ARGUMENTS.search(template) is not None))

    def render(self, req: ChatCompletionRequest | list[ChatMessage], add_generation_prompt: bool = True
               ) -> ChatPrompt:
        if self.tokenizer is None:
            raise RequestError("chat needs a tokenizer (the server runs with skip_tokenizer_init)", param="messages")
        if not isinstance(req, ChatCompletionRequest):
            text = self._apply(req, add_generation_prompt, None, {})
            return ChatPrompt(self.tokenizer.encode(text, add_special_tokens=False), text,
                              starts_in_reasoning=self.think and opens_reasoning(text))
        plan = ToolPlan.of(req)
        if plan.tools and self.tool_parser is None:
            raise RequestError("this model's chat template has no tool-call format, so it cannot use tools",
                               param="tools")
        if plan.tools and self.variables is not None and "tools" not in self.variables:
            raise RequestError("this model's chat template does not show tools to the model (it never reads "
                               "'tools'): serve it with a chat template that does (--chat-template)", param="tools")
        text = self._apply(req.messages, req.add_generation_prompt, plan.tools, self._template_kwargs(req))
        in_reasoning = self.think and opens_reasoning(text)
        forced, grammar = self._constraint(req, plan, in_reasoning, thinking_off=text.rstrip().endswith("</think>"))
        stop = [] if plan.parallel or self.tool_parser is None or self.tool_parser.stop_after_call is None \
            else [self.tool_parser.stop_after_call]
        # The rendered text already holds the special tokens: do not add BOS again.
        ids = self.tokenizer.encode(text + forced, add_special_tokens=False)
        return ChatPrompt(ids, text + forced, plan.tools, forced, starts_in_reasoning=in_reasoning, stop=stop,
                          grammar=grammar, keep_special_tokens=bool(self.special_tags))

    def thinking_switch(self, enabled: bool) -> dict[str, Any] | None:
        """Qwen3, Qwen3.5 and GLM-4.5 templates read `enable_thinking`."""
        return {"enable_thinking": enabled} if self.variables is not None and "enable_thinking" in self.variables \
            else None

    def _special_tags(self) -> SpecialTags:
        """The tags the output parsers read that are special tokens of this tokenizer (decoding with
        skip_special_tokens drops them; in some tokenizers <think> or the tool-call markers are): chat outputs are
        then decoded keeping special tokens (the end token is never part of the text), and grammars match these
        tags by token id. Logged, as every automatic choice."""
        tags = (self.tool_parser.tags if self.tool_parser is not None else ()) + \
            ((THINK_OPEN, THINK_CLOSE) if self.think else ())
        if self.tokenizer is None or not tags:
            return ()
        found = []
        for tag in tags:
            ids = self.tokenizer.encode(tag, add_special_tokens=False)
            if len(ids) == 1 and self.tokenizer.decode(ids, skip_special_tokens=True) != tag:
                found.append((tag, ids[0]))
        if found:
            log.info("chat: %s are special tokens of this tokenizer: chat outputs are decoded keeping special "
                     "tokens (skip_special_tokens false), and grammars match them by id",
                     ", ".join(tag for tag, _ in found))
        return tuple(found)

    def _constraint(self, req: ChatCompletionRequest, plan: ToolPlan, in_reasoning: bool, thinking_off: bool
                    ) -> tuple[str, GrammarSpec | None]:
        """(text appended to the prompt, the output's grammar). A template with <think> tags may reason before a
        constrained answer or a forced call: the grammar lets the reasoning run free up to its first </think>
        (opened by the prompt, or optional unless the prompt ends with a closed, empty one: thinking switched off),
        then holds the answer (a call's opening included) to its constraint. Without a grammar for the call, its
        opening goes in the prompt, after an empty reasoning."""
        grammar = grammar_spec(req)
        reasoning: Literal["open", "optional"] | None = None
        if self.think and not thinking_off:
            reasoning = "open" if in_reasoning else "optional"
        specials = self.special_tags
        if not (plan.forced and self.tool_parser is not None):
            return "", replace(grammar, reasoning=reasoning, special_tags=specials) if grammar is not None else None
        opening = self.tool_parser.forced_prefix(plan.function_name)
        call = self.tool_parser.call_grammar(plan.tools or [], plan.function_name)
        if call is None:
            return ("</think>\n\n" if in_reasoning else "") + opening, None
        call = with_special_tokens(call, specials)
        if reasoning is None:
            return opening, GrammarSpec("lark", call, "tools")
        return "", GrammarSpec("lark", call, "tools", reasoning, prefix=opening, special_tags=specials)

    def _template_kwargs(self, req: ChatCompletionRequest) -> dict[str, Any]:
        """chat_template_kwargs (and reasoning_effort) checked against what the template reads: a name it does
        not read would be silently ignored, so it is a 400 with a "did you mean"."""
        kwargs = dict(req.chat_template_kwargs or {})
        if req.reasoning_effort is not None:
            if self.variables is not None and "reasoning_effort" not in self.variables:
                raise RequestError("reasoning_effort: this model's chat template has no reasoning-effort switch"
                                   + self._switches(), param="reasoning_effort")
            kwargs["reasoning_effort"] = req.reasoning_effort
        for name in kwargs:
            if name in RESERVED_TEMPLATE_KWARGS:
                raise RequestError(f"chat_template_kwargs: {name!r} is set by the request itself",
                                   param="chat_template_kwargs")
            if self.variables is not None and name not in self.variables:
                close = difflib.get_close_matches(name, sorted(self.variables), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else self._switches()
                raise RequestError(f"chat_template_kwargs: this model's chat template does not read {name!r}{hint}",
                                   param="chat_template_kwargs")
        return kwargs

    def _switches(self) -> str:
        known = sorted((self.variables or set()) - RESERVED_TEMPLATE_KWARGS - {"bos_token", "eos_token",
                                                                              "raise_exception", "strftime_now"})
        return f"; it reads: {', '.join(known)}" if known else ""

    def _apply(self, messages: list[ChatMessage], add_generation_prompt: bool, tools: list[dict[str, Any]] | None,
               kwargs: dict[str, Any]) -> str:
        try:
            rendered = [_template_message(m, self.null_content, self.arguments_as_text) for m in messages]
            return str(self.tokenizer.apply_chat_template(rendered,
                                                          add_generation_prompt=add_generation_prompt, tools=tools,
                                                          **({"limits": self.limits} if self.limits else {}),
                                                          **kwargs))
        except RequestError:
            raise
        except Exception as err:  # a template that fails on this input (TypeError ...) is a bad request
            raise RequestError(f"chat template error: {type(err).__name__}: {err}", param="messages") from None

    def new_parser(self, prompt: ChatPrompt) -> OutputParser:
        think = ThinkTagSplitter(prompt.starts_in_reasoning) if self.think else None
        tools = self.tool_parser(prompt.tools) if prompt.tools and self.tool_parser is not None else None
        return _TemplateParser(think, tools, prompt.forced_text)


# ---------------------------------------------------------------------------------------------------- harmony
class _HarmonyParser(OutputParser):
    def __init__(self, encoding: Any, forced_ids: list[int]) -> None:
        self.inner = HarmonyOutputParser(encoding)
        self._prefix = list(forced_ids)  # the prompt's forced start of a call: parsed as if generated

    def feed(self, delta: Delta) -> ChatDelta:
        ids, self._prefix = self._prefix + delta.token_ids, []
        d = self.inner.feed(ids)
        return ChatDelta(reasoning=d.reasoning, content=d.content, tool_calls=d.tool_calls)

    def flush(self) -> ChatDelta:
        d = self.inner.flush()
        return ChatDelta(reasoning=d.reasoning, content=d.content, tool_calls=d.tool_calls)

    def has_content(self) -> bool:
        return self.inner.saw_final or self.inner.broken

    def cut_in_reasoning(self) -> bool:
        return self.inner.channel in ("analysis", "commentary") and not self.inner.saw_final


class HarmonyChat(ChatFormat):
    name = "harmony (openai-harmony)"

    def __init__(self, model_folder: Path | None) -> None:
        self.vocab_folder = vocab_folder(model_folder)
        self.encoding = load_encoding(str(self.vocab_folder))
        self._compiler: GrammarCompiler | None = None

    def render(self, req: ChatCompletionRequest | list[ChatMessage], add_generation_prompt: bool = True
               ) -> ChatPrompt:
        from openai_harmony import Role

        if not isinstance(req, ChatCompletionRequest):
            ids = self.encoding.render_conversation_for_completion(build_conversation(req), Role.ASSISTANT)
            return ChatPrompt(list(ids), None)
        if req.chat_template_kwargs:
            raise RequestError("chat_template_kwargs: harmony (gpt-oss) has no chat template; its switch is "
                               "reasoning_effort", param="chat_template_kwargs")
        plan = ToolPlan.of(req)
        conversation = build_conversation(req.messages, plan.tools, req.reasoning_effort)
        ids = list(self.encoding.render_conversation_for_completion(conversation, Role.ASSISTANT))
        grammar = grammar_spec(req)
        header = "<|channel|>final<|message|>" if grammar is not None else ""  # a constrained answer: no analysis
        if plan.forced:  # harmony's own header of a call: the model writes the name (unless named) and arguments
            header = "<|channel|>commentary to=functions." + (
                f"{plan.function_name} <|constrain|>json<|message|>" if plan.function_name else "")
            # the call (its name when not named, then arguments following its schema) ends with <|call|>, a stop token
            grammar = GrammarSpec("lark", harmony_call_grammar(plan.tools or [], plan.function_name), "tools")
        forced = list(self.encoding.encode(header, allowed_special="all")) if header else []
        return ChatPrompt(ids + forced, None, plan.tools, forced_ids=forced, grammar=grammar)

    def stop_token_ids(self) -> list[int]:
        return list(self.encoding.stop_tokens_for_assistant_actions())

    def grammar_compiler(self, llm: Any) -> Any:
        """The engine's compiler; without a tokenizer.json (or with skip_tokenizer_init), one built from the
        harmony vocabulary the format already reads (on the first constrained request, off the event loop)."""
        compiler = super().grammar_compiler(llm)
        if compiler is None and self._compiler is None:
            vocab_size = int(llm.spec.vocab_size)
            folder, encoding = self.vocab_folder, self.encoding
            stops = self.stop_token_ids()
            self._compiler = GrammarCompiler(None, vocab_size, stops, make_ll_tokenizer=(
                f"the harmony vocabulary ({VOCAB_FILE})", lambda: grammar_tokenizer(folder, encoding, vocab_size)))
        return compiler if compiler is not None else self._compiler

    def new_parser(self, prompt: ChatPrompt) -> OutputParser:
        return _HarmonyParser(self.encoding, prompt.forced_ids)


# model_type (config.json) -> chat format; anything else uses the model's jinja template.
CHAT_FORMATS: dict[str, Callable[[Any, Path | None], ChatFormat]] = {
    "gpt_oss": lambda tokenizer, folder: HarmonyChat(folder),
}


def chat_format_for(model_type: str | None, tokenizer: Any, model_folder: Path | None,
                    limits: RenderLimits | None = None) -> ChatFormat:
    """The chat format of `model_type`; a jinja template renders within `limits`."""
    make = CHAT_FORMATS.get(model_type or "")
    return make(tokenizer, model_folder) if make is not None else TemplateChat(tokenizer, limits)
