"""Shared by the offloaded == resident tests: run a generate and keep the logits of every engine step."""

from __future__ import annotations

from typing import Any

import torch


def generate_capturing_logits(llm: Any, prompts: list, params: Any) -> tuple[list[torch.Tensor], list]:
    """(logits [num_seqs, vocab] of each engine step, the RequestOutputs); closes the engine afterwards."""
    engine = llm.engine
    logits: list[torch.Tensor] = []
    forward = engine.model.forward

    def capture(batch, kv):  # noqa: ANN001, ANN202
        out = forward(batch, kv)
        logits.append(out.clone())
        return out

    engine.model.forward = capture
    try:
        outs = llm.generate(prompts, params)
    finally:
        engine.close()
    return logits, outs
