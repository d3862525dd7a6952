"""Grammar constraints by llguidance: a JSON schema, a regex, a choice or a Lark grammar, compiled once per request
(cached by text), then masked token by token in the sampler (logits_processor.py's interface).

Why llguidance (rather than xgrammar or outlines-core): it is a CPU library first (Rust, an abi3 wheel with no
Python dependencies, MIT), it builds its token trie straight from a `tokenizers` JSON (the file moeserve already
reads), it computes a mask lazily per step in tens of microseconds without a precomputed per-state table (so a new
schema compiles in milliseconds), and it covers JSON Schema, regexes and Lark grammars with `%json` inside them
(which the tool-call grammars use). xgrammar's wheel requires transformers and, on Linux x86_64, triton (hundreds
of MB) at run time and applies its masks with torch kernels aimed at GPUs; outlines-core precompiles an index over
the whole vocabulary per regex, which is slow for large schemas.

JSON is generated on one line with `", "` and `": "` separators (`whitespace_flexible` off): a model cannot loop
on whitespace, and the text is what `json.dumps` writes. A schema's own `x-guidance` options win.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from moeserve.engine.logits_processor import Constraint, LogitsProcessor
from moeserve.errors import RequestError

log = logging.getLogger("moeserve")

GrammarKind = Literal["json_schema", "regex", "choice", "lark"]
SpecialTags = tuple[tuple[str, int], ...]  # (tag text, token id) for tags that are special tokens
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_GRAMMAR_CHARS = 1_000_000  # a request's schema or grammar, as text


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to. `value`: a JSON schema (dict), a regex, a list of strings, or a Lark
    grammar in llguidance's dialect (`%json {schema}` embeds a schema)."""

    kind: GrammarKind
    value: Any
    param: str  # the request field it came from, named in errors
    # Reasoning allowed before the constrained answer: "open" (the prompt opened <think>: free text up to the first
    # </think>), "optional" (the output may start with <think>...</think>), or None (the answer comes at once).
    reasoning: Literal["open", "optional"] | None = None
    prefix: str = ""  # literal text the answer starts with (a tool call's opening, after any reasoning)
    special_tags: SpecialTags = ()  # tags that are special tokens of the tokenizer (matched by id, not by text)

    def text(self) -> str:
        """The llguidance grammar (its JSON form). Raises RequestError for a value of the wrong shape."""
        answer = self._answer_text()
        if self.reasoning is None and not self.prefix:
            return answer
        return after_reasoning(answer, self.reasoning, self.prefix, self.special_tags)

    def _answer_text(self) -> str:
        from llguidance import LLMatcher

        if self.kind == "json_schema":
            if not isinstance(self.value, dict):
                raise RequestError("the JSON schema must be an object", param=self.param)
            try:
                return str(LLMatcher.grammar_from_json_schema(with_json_options(self.value)))
            except ValueError as err:
                raise RequestError(f"invalid JSON schema: {_one_line(err)}", param=self.param) from None
        if self.kind == "regex":
            return str(LLMatcher.grammar_from_regex(self.value))
        if self.kind == "choice":
            return str(LLMatcher.grammar_from_lark(choice_lark(self.value)))
        return str(LLMatcher.grammar_from_lark(self.value))


AFTER_THINK = '("\\n" "\\n"?)?'  # the newlines templates put between </think> and the answer


def after_reasoning(answer: str, reasoning: str | None, prefix: str, specials: SpecialTags = ()) -> str:
    """A grammar (llguidance's JSON form) of optional reasoning, then `prefix`, then the grammar `answer` (Lark text
    or JSON form), which is referenced as a sub-grammar so that any kind of constraint can follow reasoning. The
    reasoning is free text up to the first </think> (a lazy lexeme; when </think> is a special token, text, which
    cannot hold a special token, then that token)."""
    if answer.lstrip().startswith("{"):
        grammars = json.loads(answer)["grammars"]
    else:
        grammars = [{"lark_grammar": answer}]
    grammars[0] = {**grammars[0], "name": "answer"}
    opening = lark_literal("<think>", specials)
    think = {"open": f"think {AFTER_THINK} ", "optional": f'("\\n"? {opening} think {AFTER_THINK})? ',
             None: ""}[reasoning]
    start = think + (lark_literal(prefix, specials) + " " if prefix else "") + "@answer"
    close = dict(specials).get("</think>")
    body = r"think[lazy]: /(?s:.*)<\/think>/" if close is None else f"think: /(?s:.*)/ <[{close}]>"
    top = f"start: {start}\n{body}\n" if reasoning else f"start: {start}\n"
    return json.dumps({"grammars": [{"name": "start", "lark_grammar": top}, *grammars]})


def lark_regex_literal(text: str) -> str:
    """`text` as a literal inside a Lark /regex/."""
    return "".join("\\n" if ch == "\n" else "\\/" if ch == "/" else "\\" + ch if ch in ".^$*+?{}[]\\|()" else ch
                   for ch in text)


def lark_literal(text: str, specials: SpecialTags = ()) -> str:
    """`text` as a Lark sequence: quoted pieces, and llguidance's `<[id]>` for each special-token tag in it (a
    quoted tag would have to be spelled in ordinary tokens)."""
    pieces: list[str | int] = [text]
    for tag, token_id in specials:
        split: list[str | int] = []
        for piece in pieces:
            if isinstance(piece, int):
                split.append(piece)
                continue
            for i, part in enumerate(piece.split(tag)):
                split.extend(([token_id] if i else []) + ([part] if part else []))
        pieces = split
    out = [f"<[{p}]>" if isinstance(p, int) else json.dumps(p, ensure_ascii=False) for p in pieces]
    return " ".join(out) if out else '""'


_LARK_ITEM = re.compile(r'%json\s*|"(?:[^"\\]|\\.)*"|/(?:[^/\\\n]|\\.)*/')


def with_special_tokens(lark: str, specials: SpecialTags) -> str:
    """A Lark grammar built by moeserve (call grammars) with its special-token tags matched by id: in quoted
    literals (never inside `%json` schemas), and at the end of a lazy text lexeme (`x[lazy]: /(?s:...)TAG.../`
    becomes text, then the token, then the rest)."""
    if not specials:
        return lark
    for tag, token_id in specials:
        lazy = re.compile(r"\[lazy\]: /(\(\?s:(?:[^/\\]|\\.)*?\))" + re.escape(lark_regex_literal(tag))
                          + r"((?:\\n)*)/")
        def text_then_token(m: re.Match[str], token_id: int = token_id) -> str:
            return f": /{m.group(1)}/ <[{token_id}]>" + ' "\\n"' * (len(m.group(2)) // 2)

        lark = lazy.sub(text_then_token, lark)
    out, at = [], 0
    while (m := _LARK_ITEM.search(lark, at)) is not None:
        out.append(lark[at:m.start()])
        if m.group().startswith("%json"):
            _, end = json.JSONDecoder().raw_decode(lark, m.end())  # the schema is copied as it is
            out.append(lark[m.start():end])
            at = end
            continue
        item = m.group()
        out.append(lark_literal(json.loads(item), specials) if item.startswith('"') else item)
        at = m.end()
    return "".join(out) + lark[at:]


def with_json_options(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with moeserve's JSON layout (JSON_OPTIONS) unless it sets its own `x-guidance`."""
    return schema if "x-guidance" in schema else {**schema, "x-guidance": JSON_OPTIONS}


def choice_lark(choices: list[str]) -> str:
    """A Lark grammar matching exactly one of `choices` (JSON string literals are valid Lark literals)."""
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _one_line(err: object) -> str:
    text = " ".join(str(err).split())
    return text[:300] + ("..." if len(text) > 300 else "")


class GrammarConstraint(Constraint):
    """A compiled grammar: a matcher in its start state, copied for each sequence."""

    def __init__(self, matcher: Any, vocab_size: int, grammar_eos: list[int]) -> None:
        self._matcher = matcher
        self._lock = threading.Lock()  # handler threads compile while the engine thread copies
        self.vocab_size, self.grammar_eos = vocab_size, grammar_eos

    def new_processor(self, end_token_ids: set[int]) -> GrammarProcessor:
        with self._lock:
            matcher = self._matcher.deep_copy()
        return GrammarProcessor(matcher, self.vocab_size, self.grammar_eos, sorted(end_token_ids))


class GrammarProcessor(LogitsProcessor):
    """One sequence's llguidance matcher and its mask buffer."""

    def __init__(self, matcher: Any, vocab_size: int, grammar_eos: list[int], end_token_ids: list[int]) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.bitmask = np.zeros((vocab_size + 31) // 32, dtype=np.int32)  # bit t % 32 of word t // 32: token t
        self.grammar_eos = [t for t in grammar_eos if t < vocab_size]
        self.end_token_ids = [t for t in end_token_ids if t < vocab_size]
        self.mask_seconds = 0.0  # time spent computing and applying masks (`moeserve bench structured` reads it)
        self.masks = 0
        self._failure: str | None = None

    def allowed(self) -> np.ndarray:
        """bool [V]: the tokens that may come next (end tokens exactly when the grammar is satisfied)."""
        m = self.matcher
        m.unsafe_compute_mask_ptr(self.bitmask.ctypes.data, self.bitmask.nbytes)  # little-endian words
        allowed = np.unpackbits(self.bitmask.view(np.uint8), bitorder="little")[: self.vocab_size].view(np.bool_)
        if m.is_error():
            self._failed(f"the grammar engine failed: {_one_line(m.get_error())}")
            allowed[:] = False
        end_ok = m.is_error() or m.is_accepting() or not allowed.any()
        allowed[self.grammar_eos] = False  # llguidance's EOS stands for "may end": the sequence's own end tokens
        allowed[self.end_token_ids] = end_ok
        return allowed

    def mask(self, logits: torch.Tensor) -> None:
        t0 = time.perf_counter()
        allowed = self.allowed()
        logits.masked_fill_(torch.from_numpy(~allowed), float("-inf"))
        self.mask_seconds += time.perf_counter() - t0
        self.masks += 1

    def accept(self, token_id: int) -> None:
        if not self.matcher.consume_token(token_id):
            self._failed(f"the grammar engine refused token {token_id}: {_one_line(self.matcher.get_error())}")

    def is_finished(self) -> bool:
        return self._failure is not None or bool(self.matcher.is_stopped())

    def failure(self) -> str | None:
        return self._failure

    def _failed(self, why: str) -> None:
        if self._failure is None:
            log.warning("grammar constraint failed: %s", why)
            self._failure = why


class GrammarCompiler:
    """Compiles GrammarSpecs for one tokenizer. The llguidance tokenizer (its token trie: about a second for a
    150k vocabulary) is built on first use; compiled grammars are kept by text (LRU)."""

    def __init__(self, tokenizer_json: str | None, vocab_size: int, eos_token_ids: list[int], cache_size: int = 64,
                 ll_tokenizer: Any = None, make_ll_tokenizer: tuple[str, Callable[[], Any]] | None = None) -> None:
        """`tokenizer_json`: a `tokenizers` JSON; or `ll_tokenizer`, an llguidance LLTokenizer built elsewhere; or
        `make_ll_tokenizer`: (what it is built from, for the log; a function building it on first use)."""
        self._make = make_ll_tokenizer
        self._tokenizer_json = tokenizer_json
        self.vocab_size, self.eos_token_ids = vocab_size, sorted(eos_token_ids)
        self._cache: OrderedDict[str, GrammarConstraint] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = ll_tokenizer

    def _tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                from llguidance import LLTokenizer

                t0 = time.monotonic()
                if self._make is not None:
                    source, make = self._make
                    self._ll_tokenizer = make()
                else:
                    if self._tokenizer_json is None:
                        raise RequestError("structured output needs the model's tokenizer (tokenizer.json)")
                    source, eos = "tokenizer.json", self.eos_token_ids or None
                    self._ll_tokenizer = LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size, eos_token=eos)
                log.info("structured output: llguidance tokenizer built from %s in %.2f s", source,
                         time.monotonic() - t0)
            return self._ll_tokenizer

    def compile(self, spec: GrammarSpec) -> GrammarConstraint:
        """The constraint for `spec`. Raises RequestError (400) with llguidance's reason for an invalid one."""
        from llguidance import LLMatcher

        grammar = spec.text()
        if len(grammar) > MAX_GRAMMAR_CHARS:
            raise RequestError(f"the grammar is too large ({len(grammar)} characters, at most {MAX_GRAMMAR_CHARS})",
                               param=spec.param)
        with self._lock:
            hit = self._cache.get(grammar)
            if hit is not None:
                self._cache.move_to_end(grammar)
                return hit
        tokenizer = self._tokenizer()
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            what = {"json_schema": "JSON schema", "regex": "regex", "choice": "choice", "lark": "grammar"}[spec.kind]
            raise RequestError(f"invalid {what}: {_one_line(matcher.get_error())}", param=spec.param)
        constraint = GrammarConstraint(matcher, self.vocab_size, list(tokenizer.eos_tokens))
        probe = constraint.new_processor(set())
        probe.allowed()  # the first mask: a grammar the engine cannot follow from its start is known now, a 400
        if probe.failure() is not None:
            what = {"json_schema": "JSON schema", "regex": "regex", "choice": "choice", "lark": "grammar"}[spec.kind]
            raise RequestError(f"{what} the grammar engine cannot follow: {probe.failure()}", param=spec.param,
                               code="constraint_failed")
        with self._lock:
            self._cache[grammar] = constraint
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return constraint
