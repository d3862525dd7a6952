"""Tokenizer and chat template from a model folder, rendered exactly as transformers renders them.

Tokens come from `tokenizer.json` through the `tokenizers` library (a GGUF's from its metadata:
checkpoint/gguf/tokenizer.py). The chat template comes from
`chat_template.jinja`, else the `chat_template` key of `tokenizer_config.json` (or an explicit override file).
The jinja environment mirrors transformers' `apply_chat_template`: a sandbox with trim_blocks and lstrip_blocks,
loop controls, a `tojson` that does not escape HTML, `raise_exception` and `strftime_now`, and the special tokens
(`bos_token`, `eos_token`, ...) as variables. Nothing is ever downloaded.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from moeserve.checkpoint.folder import read_json
from moeserve.errors import CheckpointError, RequestError
from moeserve.template_limits import (
    LimitedSandbox,
    RenderLimits,
    TemplateLimitError,
    joined_within,
    within_time,
)

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as {"content": ...} objects."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: cannot read as UTF-8 text ({err})") from None


def _load(path: Path, make: Callable[[], Any]) -> Any:
    try:
        return make()
    except Exception as err:  # tokenizers raises a bare Exception on malformed files
        raise CheckpointError(f"{path}: cannot load tokenizer ({str(err).splitlines()[0]})") from None


LONG_TEXT_CHARS = 1 << 16  # from here on encode() releases the GIL (encode_batch of one text)


class Tokenizer:
    def __init__(self, folder: Path, chat_template_path: str | None = None) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self.config: dict[str, Any]
        if folder.is_file() and folder.suffix == ".gguf":  # a GGUF's metadata (checkpoint/gguf/tokenizer.py)
            from moeserve.checkpoint.gguf.tokenizer import gguf_tokenizer

            spec, self.config = gguf_tokenizer(folder)
            self._tok = _load(folder, lambda: HFTokenizer.from_str(spec))
        else:
            path = folder / "tokenizer.json"
            if not path.is_file():
                raise CheckpointError(
                    f"{folder}: no tokenizer.json (pass skip_tokenizer_init=True to run on token ids only)"
                )
            self._tok = _load(path, lambda: HFTokenizer.from_file(str(path)))
            self.config = read_json(folder / "tokenizer_config.json", required=False)
        self.special_tokens: dict[str, str] = {}
        for key in _SPECIAL_KEYS:
            text = _token_text(self.config.get(key))
            if text is not None:
                self.special_tokens[key] = text
        self.chat_template = self._find_template(folder, chat_template_path)

    def _find_template(self, folder: Path, override: str | None) -> str | None:
        if override:
            p = Path(override)
            if not p.is_file():
                raise CheckpointError(f"{override}: chat template file not found")
            return _read_text(p)
        jinja_file = folder / "chat_template.jinja"
        if jinja_file.is_file():
            return _read_text(jinja_file)
        template = self.config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        return template if isinstance(template, str) else None

    # ------------------------------------------------------------------------------------------- tokens
    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) >= LONG_TEXT_CHARS:
            # `tokenizers` holds the GIL through encode() but releases it in encode_batch(): a long text (seconds
            # of work) must not stop the server's event loop meanwhile. Same pipeline, same ids.
            return list(self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))

    def backend_json(self) -> str:
        """The `tokenizers` tokenizer as JSON, without padding or truncation (what llguidance reads)."""
        from tokenizers import Tokenizer as HFTokenizer

        copy = HFTokenizer.from_str(self._tok.to_str())
        copy.no_padding()
        copy.no_truncation()
        return str(copy.to_str())

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        eos = self.special_tokens.get("eos_token")
        return None if eos is None else self.token_to_id(eos)

    # --------------------------------------------------------------------------------------- chat template
    @cached_property
    def _compiled(self) -> Any:
        import jinja2.ext

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
                   sort_keys: bool = False) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        env = LimitedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        assert self.chat_template is not None
        return env.from_string(self.chat_template)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        limits: RenderLimits | None = None,
        **kwargs: Any,
    ) -> str:
        """Render `messages` with the model's template (same text as transformers' apply_chat_template); within
        `limits` (template_limits.py) when given: else TemplateLimitError."""
        if self.chat_template is None:
            raise RequestError("this model has no chat template; use completions, or pass --chat-template FILE",
                               param="messages")
        import jinja2

        chat = []
        for message in messages:
            reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
            chat.append(message)
        variables = {"messages": chat, "tools": tools, "documents": None,
                     "add_generation_prompt": add_generation_prompt, **self.special_tokens, **kwargs}
        try:
            if limits is None:
                return str(self._compiled.render(**variables))
            template = self._compiled
            template.environment.max_output_chars = limits.max_output_chars  # renders run on one thread
            return within_time(lambda: joined_within(template.generate(**variables), limits.max_output_chars),
                               limits.timeout_s)
        except jinja2.exceptions.TemplateError as err:
            raise RequestError(f"chat template error: {err}", param="messages") from None
        except TemplateLimitError as err:
            raise RequestError(str(err), param="messages") from None
