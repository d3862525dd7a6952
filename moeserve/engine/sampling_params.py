"""SamplingParams in vLLM's shape (same names, defaults and meanings)."""

from __future__ import annotations

from dataclasses import dataclass, field

from moeserve.engine.logits_processor import Constraint
from moeserve.errors import RequestError

# Temperatures below this are greedy (vLLM's rule): dividing logits by ~0 overflows to inf and NaN.
SAMPLING_EPS = 1e-5


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # >1 discourages tokens already in the prompt or output
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None  # top-k log-probabilities per generated token (plus the sampled one)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # structured output: each sequence gets a processor that masks what may come next (logits_processor.py)
    constraint: Constraint | None = None
    stop_strings: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.stop_strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        checks = [
            (self.n >= 1, "n", "must be at least 1"),
            (self.temperature >= 0, "temperature", "must be non-negative"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (self.top_k >= 0, "top_k", "must be -1 (disabled) or positive"),
            (0 <= self.min_p <= 1, "min_p", "must be in [0, 1]"),
            (0.01 <= self.repetition_penalty <= 100, "repetition_penalty", "must be in [0.01, 100]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be at least 1"),
            (self.min_tokens >= 0, "min_tokens", "must be non-negative"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be between 0 and 20"),
            (all(s for s in self.stop_strings), "stop", "stop strings must not be empty"),
        ]
        for ok, name, why in checks:
            if not ok:
                raise RequestError(f"{name} {why}, got {getattr(self, name)!r}", param=name)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS
