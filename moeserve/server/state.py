"""ServerState: what every handler needs (engine, settings, metrics, chat format), and the common checks."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moeserve.config import ServerSettings
from moeserve.engine.async_engine import AsyncEngine
from moeserve.errors import RequestError
from moeserve.server.chat_format import ChatFormat, chat_format_for
from moeserve.server.errors import APIError, from_exception, model_not_found
from moeserve.server.metrics import ServerMetrics
from moeserve.server.protocol import RequestModel, SamplingFields
from moeserve.server.request_fields import check_request_fields

log = logging.getLogger("moeserve.server")


@dataclass
class ServerState:
    engine: AsyncEngine
    settings: ServerSettings
    model_name: str
    metrics: ServerMetrics
    draining: bool = False
    _chat_format: ChatFormat | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # --------------------------------------------------------------------------------- the loaded engine
    @property
    def llm(self) -> Any:
        """The LLMEngine (or a fake) once loaded."""
        return self.engine.engine

    @property
    def tokenizer(self) -> Any:
        return getattr(self.llm, "tokenizer", None)

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
                self._chat_format = chat_format_for(model_type, self.tokenizer, folder)
            return self._chat_format

    # ------------------------------------------------------------------------------------------- checks
    def accept(self, model: str | None, body: RequestModel | None = None) -> None:
        """Raise the right APIError unless a generation request may start now."""
        if model is not None and model != self.model_name:
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
            except RequestError as err:
                raise from_exception(err) from None

    def validate_prompt(self, token_ids: list[int]) -> None:
        """The engine's own prompt checks (empty, token ids out of range), as 400s."""
        check = getattr(self.llm, "check_prompt", None)
        if check is not None:
            try:
                check(token_ids)
            except Exception as err:
                raise from_exception(err) from None
