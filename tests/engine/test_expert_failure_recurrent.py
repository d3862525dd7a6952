"""An expert that cannot be read mid-batch on a model with recurrent layers (Gated DeltaNet, Mamba-2): the failed
forward already advanced, in place, the recurrent state of every sequence in the batch in the layers before the
failing one, so running the same step again would advance it twice. The engine instead recomputes those sequences
from their tokens, one request at a time: only the requests that need the changed unit fail, and every other
answer (tokens and logprobs) is its solo answer."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from moeserve import SamplingParams
from moeserve.bench.checkpoints import write_tiny_tokenizer
from tests.fixtures.nemotron_h import write_nemotron_h
from tests.server.conftest import engine_factory
from tests.server.test_verified_bytes import check_only_requests_needing_a_changed_unit_fail


def _answer(out: Any) -> tuple[list[int], list[float]]:
    """Tokens and each token's logprob."""
    c = out.outputs[0]
    return list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]


@pytest.mark.parametrize("arch", ["qwen3_next", "nemotron_h"])
def test_only_requests_needing_the_changed_unit_fail_and_the_rest_are_exact(arch: str, tiny_checkpoint: Any,
                                                                           tmp_path: Path) -> None:
    folder = tmp_path / arch  # bf16 on disk: a miss reads the checkpoint's own bytes (no converted copy)
    if arch == "nemotron_h":
        write_nemotron_h(folder, torch.bfloat16)
    else:
        shutil.copytree(tiny_checkpoint(arch, "bfloat16"), folder)
    write_tiny_tokenizer(folder)  # the prompts are token ids; the engine still loads a tokenizer
    engine = engine_factory(folder, dtype="bfloat16", expert_cache_gb=1e-9, max_num_seqs=8)()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    try:
        check_only_requests_needing_a_changed_unit_fail(engine, params, _answer)
    finally:
        engine.close()
