"""Per-sequence logits processors: what may come next, decided by the sequence's own state.

A request that constrains its output (a JSON schema, a regex...) carries a `Constraint` in its SamplingParams; each
of its sequences gets its own `LogitsProcessor` from it. The sampler masks that sequence's row of logits before
sampling (greedy or sampled) and the sequence tells the processor each token it appends. Nothing else in the
engine knows what kind of constraint it is (grammar.py implements one with llguidance).

Batch invariance: a processor reads and writes only its own row, and a sequence without one takes exactly the
path it takes alone, so a constrained request never changes the tokens of another.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from moeserve.errors import RequestError

FINISH_CONSTRAINT_FAILED = "error"  # a sequence's finish_reason when its constraint failed mid-way


class ConstraintFailedError(RequestError):
    """A request's output constraint failed while generating (the grammar engine refused a token or its own state):
    the output so far does not satisfy it. Raised by the request's stream instead of a normal finish."""

    def __init__(self, why: str, tokens: int) -> None:
        super().__init__(f"the output constraint failed after {tokens} generated tokens ({why}); the output does "
                         "not satisfy it, so none is returned. Simplify the schema, regex or grammar",
                         param=None, code="constraint_failed")


class LogitsProcessor(ABC):
    """The state of one sequence's constraint."""

    @abstractmethod
    def mask(self, logits: torch.Tensor) -> None:
        """Set the logits of the tokens that may not come next to -inf, in place. logits: fp32 [V], one row."""

    @abstractmethod
    def accept(self, token_id: int) -> None:
        """Advance past a sampled token (one the last mask allowed; an end token is never passed here)."""

    @abstractmethod
    def is_finished(self) -> bool:
        """True when nothing may follow: the sequence ends here (finish_reason "stop")."""

    def failure(self) -> str | None:
        """Why the constraint can no longer be followed (its engine failed), else None: the sequence then ends with
        finish_reason FINISH_CONSTRAINT_FAILED, never as a normal stop."""
        return None


class Constraint(ABC):
    """A compiled constraint shared by the sequences of a request (and by requests that ask for the same)."""

    @abstractmethod
    def new_processor(self, end_token_ids: set[int]) -> LogitsProcessor:
        """A processor in the start state. `end_token_ids` end the sequence (EOS, stop_token_ids): they are
        allowed exactly when the constraint is satisfied."""
