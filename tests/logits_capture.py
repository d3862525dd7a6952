"""Shared by the offloaded == resident tests: run a generate and keep the logits of every engine step."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


@contextmanager
def capturing_logits(engine: Any) -> Iterator[list[torch.Tensor]]:
    """While inside: a copy of the logits [num_seqs, vocab] of each engine step is appended to the list yielded."""
    logits: list[torch.Tensor] = []
    forward = engine.model.forward

    def capture(batch, kv):  # noqa: ANN001, ANN202
        out = forward(batch, kv)
        logits.append(out.clone())
        return out

    engine.model.forward = capture
    try:
        yield logits
    finally:
        engine.model.forward = forward


def generate_capturing_logits(llm: Any, prompts: list, params: Any) -> tuple[list[torch.Tensor], list]:
    """(logits [num_seqs, vocab] of each engine step, the RequestOutputs); closes the engine afterwards."""
    try:
        with capturing_logits(llm.engine) as logits:
            outs = llm.generate(prompts, params)
    finally:
        llm.engine.close()
    return logits, outs
