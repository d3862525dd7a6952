"""Sequence: one sample being generated (a request with n > 1 owns n of them), and its stop rules."""

from __future__ import annotations

import enum
from collections.abc import Callable

import torch

from moeserve.engine.logits_processor import FINISH_CONSTRAINT_FAILED, LogitsProcessor
from moeserve.engine.outputs import CompletionOutput, Logprob
from moeserve.engine.sampling_params import SamplingParams
from moeserve.state.manager import SeqBlocks


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, index: int, prompt_token_ids: list[int], params: SamplingParams,
                 max_model_len: int, eos_token_ids: set[int]) -> None:
        self.request_id, self.index = request_id, index
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.output_token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.status = Status.WAITING
        self.blocks: SeqBlocks | None = None  # its KV blocks (the scheduler gives them)
        self.first_sibling: Sequence | None = None  # sequence 0 of its request (n > 1 share its prompt)
        self.num_cached = 0  # tokens whose K/V are in the cache
        self.text = ""  # detokenized output (stop string cut applied once finished)
        # Incremental detokenization (what vLLM does): each step decodes only the tokens from _prefix_offset on
        # and keeps the part after what tokens [_prefix_offset, _read_offset) decode to; a step whose tail is an
        # incomplete UTF-8 character (decoded as U+FFFD) waits for the next token. Decoding the whole output every
        # step instead costs O(length) per step: quadratic over a long generation.
        self._prefix_offset = 0
        self._read_offset = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.max_model_len = max_model_len
        self.eos_token_ids = set() if params.ignore_eos else eos_token_ids
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed + index)
        self.logits_processor: LogitsProcessor | None = None  # the sampler masks this sequence's row with it
        if params.constraint is not None:
            ends = self.eos_token_ids | set(params.stop_token_ids or [])
            self.logits_processor = params.constraint.new_processor(ends)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def length(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def tokens_to_compute(self, n: int) -> list[int]:
        """The next `n` tokens whose K/V are not cached yet (prompt chunks at first, then the last sampled token)."""
        return self.all_token_ids[self.num_cached : self.num_cached + n]

    def append(self, token_id: int, logprobs: dict[int, Logprob] | None,
               detokenize: Callable[[list[int]], str] | None) -> None:
        """Add a sampled token, update the text, and decide whether the sequence is finished."""
        p = self.params
        self.output_token_ids.append(token_id)
        if logprobs is not None and self.logprobs is not None:
            self.logprobs.append(logprobs)
            self.cumulative_logprob += logprobs[token_id].logprob
        n_out = len(self.output_token_ids)
        if self.logits_processor is not None and self.logits_processor.failure() is not None:  # its mask failed
            self._finish(FINISH_CONSTRAINT_FAILED, self.logits_processor.failure())
            return
        if n_out >= p.min_tokens and (token_id in self.eos_token_ids or token_id in (p.stop_token_ids or [])):
            self._finish("stop", token_id)
            if detokenize is not None:  # the stop token itself is not part of the text
                self._detokenize(detokenize, n_out - 1, final=True)
            return
        constrained_end = False  # the constraint allows nothing after this token
        if self.logits_processor is not None:
            self.logits_processor.accept(token_id)
            constrained_end = self.logits_processor.is_finished()
        if detokenize is not None:
            # the text already searched for stop strings (none before min_tokens is reached: then all of it)
            searched = len(self.text) if n_out > max(1, p.min_tokens) else 0
            final = ((p.max_tokens is not None and n_out >= p.max_tokens) or self.length >= self.max_model_len
                     or constrained_end)
            self._detokenize(detokenize, n_out, final)
            if p.stop_strings and n_out >= p.min_tokens and self._cut_at_stop_string(searched):
                return
        failure = self.logits_processor.failure() if self.logits_processor is not None else None
        if failure is not None:
            self._finish(FINISH_CONSTRAINT_FAILED, failure)
        elif constrained_end:
            self._finish("stop")
        elif p.max_tokens is not None and n_out >= p.max_tokens:
            self._finish("length")
        elif self.length >= self.max_model_len:
            self._finish("length")

    def _detokenize(self, detokenize: Callable[[list[int]], str], end: int, final: bool) -> None:
        """Extend `text` with output tokens [_read_offset, end); `final` also takes an incomplete last character."""
        ids = self.output_token_ids
        start, read = self._prefix_offset, self._read_offset
        before = detokenize(ids[start:read]) if read > start else ""
        after = detokenize(ids[start:end])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.text += after[len(before):]
            self._prefix_offset, self._read_offset = read, end

    def _cut_at_stop_string(self, searched: int) -> bool:
        """Cut at the first stop string that ends past text[:searched] (the text before this step was searched)."""
        for stop in self.params.stop_strings:
            at = self.text.find(stop, max(0, searched - len(stop) + 1))
            if at != -1:
                self.text = self.text[: at + len(stop)] if self.params.include_stop_str_in_output else self.text[:at]
                self._finish("stop", stop)
                return True
        return False

    def _finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status = Status.FINISHED
        self.finish_reason, self.stop_reason = reason, stop_reason

    def abort(self) -> None:
        if self.status != Status.FINISHED:
            self._finish("abort")

    def visible_text(self) -> str:
        """Text safe to show now: while running, hold back what could still become a stop string, and a trailing
        partial UTF-8 character (decoded as U+FFFD)."""
        if self.status == Status.FINISHED:
            return self.text
        text = self.text.rstrip("\ufffd")
        hold = max((len(s) for s in self.params.stop_strings), default=1) - 1
        return text[: len(text) - hold] if hold > 0 else text

    def output(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.visible_text(),
            token_ids=list(self.output_token_ids),
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
