"""ServerState: what every handler needs (engine, settings, metrics, chat format), and the common checks."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from moeserve.config import ServerSettings
from moeserve.engine.async_engine import AsyncEngine, EngineDeadError, State
from moeserve.engine.sampling_defaults import ChosenSampling, server_sampling
from moeserve.errors import RequestError
from moeserve.server.chat_format import ChatFormat, chat_format_for
from moeserve.server.errors import APIError, from_exception, model_not_found
from moeserve.server.metrics import ServerMetrics
from moeserve.server.protocol import ModelCard, RequestModel, SamplingFields
from moeserve.server.request_fields import check_ranges, check_request_fields
from moeserve.server.request_memory import RequestMemory
from moeserve.template_limits import RenderLimits

log = logging.getLogger("moeserve.server")
T = TypeVar("T")

# Streams still open this long before uvicorn's graceful-shutdown deadline are ended by the server (an error event,
# then [DONE]) rather than cut mid-body by uvicorn's task cancellation.
STREAM_CUT_MARGIN_S = 0.5
TEXT_BYTES_MARGIN = 4  # a normalizer may shrink text (NFKC: a 3-byte full-width letter to 1 byte)
_ABSENT = object()


@dataclass
class ServerState:
    engine: AsyncEngine
    settings: ServerSettings
    model_name: str
    metrics: ServerMetrics
    # every name a request may give in `model` (--served-model-name's several; MODEL as given and its folder's
    # name); `model_name`, the first, is the one answered
    aliases: tuple[str, ...] = ()
    draining: bool = False
    # what requests may hold (request_memory_mb, a line of the memory split); None: not bounded (tests)
    request_memory: RequestMemory | None = None
    loop: asyncio.AbstractEventLoop | None = None  # the server's, set at start-up (for the shutdown timer)
    _chat_format: ChatFormat | None = None
    _sampling: ChosenSampling | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # Tokenization and template rendering run here, off the event loop (a 10 MB prompt took ~14 s and stalled
    # every stream and /health). One thread: HF fast tokenizers are not safe to reconfigure concurrently, and one
    # big prompt at a time bounds the memory it takes.
    _text_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="moeserve-tokenize"))

    _text_jobs: int = 0  # queued or running on the tokenization thread
    _longest_token: int | None = None  # the longest token's UTF-8 bytes (check_text_fits), once known

    async def off_loop(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on the tokenization thread; the event loop keeps serving meanwhile. The queue is
        bounded like the engine's (max_num_seqs + max_queued_requests): a 503 beyond it."""
        if self._text_jobs >= self.engine.max_in_flight:
            raise APIError(503, f"{self._text_jobs} requests are waiting to be tokenized, the most this server "
                           "queues (max_num_seqs + max_queued_requests); retry shortly", "server_error",
                           code="server_busy", headers={"Retry-After": "1"})
        loop = asyncio.get_running_loop()
        self._text_jobs += 1
        try:
            return await loop.run_in_executor(self._text_pool, functools.partial(fn, *args, **kwargs))
        finally:
            self._text_jobs -= 1

    def close(self) -> None:
        self._text_pool.shutdown(wait=False, cancel_futures=True)

    def begin_drain(self) -> None:
        """Refuse new work (503) from now on; streams still open `shutdown_timeout` - STREAM_CUT_MARGIN_S from
        now end with an error event and [DONE] instead of being cut mid-body. Safe from a signal handler."""
        if self.draining:
            return
        self.draining = True
        if self.loop is None:
            return
        delay = max(0.0, self.settings.shutdown_timeout - STREAM_CUT_MARGIN_S)
        self.loop.call_soon_threadsafe(self.loop.call_later, delay, self._end_open_streams)

    def _end_open_streams(self) -> None:
        timeout = self.settings.shutdown_timeout
        ended = self.engine.end_streams(EngineDeadError(
            f"the server is shutting down and its shutdown timeout ({timeout:g} s) ran out before this request "
            "finished; retry on another server or later"))
        if ended:
            log.warning("shutdown timeout (%g s) reached: ended %d open request(s) with an error", timeout, ended)

    # --------------------------------------------------------------------------------- the loaded engine
    @property
    def llm(self) -> Any:
        """The LLMEngine (or a fake) once loaded."""
        return self.engine.engine

    @property
    def tokenizer(self) -> Any:
        return getattr(self.llm, "tokenizer", None)

    @property
    def vocab_size(self) -> int | None:
        """The model's vocabulary size (None for an engine that does not say, as test fakes)."""
        size = getattr(getattr(self.llm, "spec", None), "vocab_size", None)
        return size if isinstance(size, int) else None

    @property
    def max_model_len(self) -> int:
        return int(self.llm.max_model_len)

    @property
    def max_num_seqs(self) -> int:
        settings = getattr(self.llm, "settings", None)
        return int(getattr(settings, "max_num_seqs", self.engine.max_in_flight))

    def chat_format(self) -> ChatFormat:
        with self._lock:
            if self._chat_format is None:
                checkpoint = getattr(self.llm, "checkpoint", None)
                model_type = checkpoint.config.get("model_type") if checkpoint is not None else None
                folder = Path(checkpoint.path) if checkpoint is not None else None
                limits = RenderLimits(self.settings.template_timeout_s, int(self.settings.template_max_output_mb * 1e6))
                self._chat_format = chat_format_for(model_type, self.tokenizer, folder, limits)
            return self._chat_format

    @property
    def served_names(self) -> tuple[str, ...]:
        """The names a request may give in `model`, the answered one first."""
        return (self.model_name, *(a for a in self.aliases if a != self.model_name))

    def model_cards(self, verbose: bool = False) -> list[ModelCard]:
        """/v1/models' records, one per served name: no local path. `verbose` adds every start-up choice as logged
        (`startup_choices`, paths included) and the sampling defaults."""
        ready = self.engine.state == State.READY
        max_len = self.max_model_len if ready else None
        choices = (self.engine.startup_choices() or None) if verbose else None
        sampling = self.sampling_defaults().values if verbose and ready else None
        return [ModelCard(id=name, max_model_len=max_len, startup_choices=choices, sampling_defaults=sampling)
                for name in self.served_names]

    def sampling_defaults(self) -> ChosenSampling:
        """What a request's unset sampling fields get (the generation_config setting: the model's
        generation_config.json by default, as vLLM does); read once, after the model loaded."""
        with self._lock:
            if self._sampling is None:
                checkpoint = getattr(self.llm, "checkpoint", None)
                config = getattr(checkpoint, "generation_config", None) or {}
                self._sampling = server_sampling(self.settings.generation_config, config)
            return self._sampling

    def default_max_tokens(self) -> int | None:
        """The model's max_new_tokens (generation_config), given to a request that sets no max_tokens."""
        return self.sampling_defaults().values.get("max_tokens")

    # ------------------------------------------------------------------------------------------- checks
    def accept(self, model: str | None, body: RequestModel | None = None) -> None:
        """Raise the right APIError unless a generation request may start now; then give the body's unset
        sampling fields (temperature, top_p, top_k, min_p, repetition_penalty) the server's defaults."""
        if model is not None and model not in self.served_names:
            raise model_not_found(model)
        if self.draining:
            raise APIError(503, "the server is shutting down", "server_error", code="shutting_down",
                           headers={"Retry-After": "5"})
        try:
            self.engine.check_ready()
        except Exception as err:
            raise from_exception(err) from None
        if isinstance(body, SamplingFields):
            try:
                check_request_fields(body)
                check_ranges(body, self.vocab_size)
            except RequestError as err:
                raise from_exception(err) from None
        if body is not None:
            for name, value in self.sampling_defaults().values.items():
                if name != "max_tokens" and getattr(body, name, _ABSENT) is None:
                    setattr(body, name, value)  # as vLLM's to_sampling_params: only fields the request left unset

    def check_text_fits(self, text: str, param: str) -> None:
        """A 400 (context_length_exceeded) without tokenizing, when `text` certainly holds more tokens than the
        context: more than TEXT_BYTES_MARGIN x the longest token's bytes x max_model_len bytes (a token covers at
        most that many; the margin covers normalizers that shrink text). Tokenizing a 15 MB text takes seconds to
        minutes and gigabytes; this refusal takes microseconds."""
        longest = self.longest_token_bytes
        if longest is None:
            return
        limit = TEXT_BYTES_MARGIN * longest * self.max_model_len
        if len(text) > limit or len(text.encode("utf-8", "surrogatepass")) > limit:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                           f"your {param} is {len(text)} characters, more than {limit} (at least "
                           f"{self.max_model_len + 1} tokens, whatever the tokenizer). Please reduce the length of "
                           f"the {param}.", param=param, code="context_length_exceeded")

    @property
    def longest_token_bytes(self) -> int | None:
        """The most UTF-8 bytes any token's text takes (None without a tokenizer that lists its vocabulary)."""
        if self._longest_token is None:
            tok = getattr(self.tokenizer, "_tok", None)
            vocab = tok.get_vocab(with_added_tokens=True) if tok is not None else None
            self._longest_token = max((len(t.encode()) for t in vocab), default=0) if vocab else None
        return self._longest_token or None

    def validate_prompt(self, token_ids: list[int]) -> None:
        """The engine's own prompt checks (empty, token ids out of range), as 400s."""
        check = getattr(self.llm, "check_prompt", None)
        if check is not None:
            try:
                check(token_ids)
            except Exception as err:
                raise from_exception(err) from None
