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
from moeserve.errors import ExpertLoadError
from tests.conftest import write_tiny_tokenizer
from tests.models.nemotron_h_checkpoints import write_nemotron_h
from tests.server.conftest import engine_factory
from tests.server.test_verified_bytes import PROMPTS, RoutingLog, flip_expert_bytes, pick_target


def _answer(out: Any) -> tuple[list[int], list[float]]:
    c = out.outputs[0]
    return list(c.token_ids), [next(iter(lp.values())).logprob if hasattr(next(iter(lp.values())), "logprob")
                               else float(next(iter(lp.values()))) for lp in (c.logprobs or [])]


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
        routing = RoutingLog(engine)
        solo, used = {}, {}
        for i, p in enumerate(PROMPTS):
            engine.add_request(p, params, str(i))
            while engine.has_unfinished_requests():
                solo.update({out.request_id: _answer(out) for out in engine.step() if out.finished})
            used[i] = routing.take()
        target, others = pick_target(used)
        path = flip_expert_bytes(engine, target)
        for i, p in enumerate(PROMPTS):
            engine.add_request(p, params, f"b{i}")
        final = {}
        while engine.has_unfinished_requests():
            final.update({out.request_id: out for out in engine.step() if out.finished})
        failed = {int(rid[1:]) for rid, out in final.items() if out.error is not None}
        assert 0 in failed and not failed & set(others)
        assert failed <= {i for i in used if target in used[i]}
        assert len(final) == len(PROMPTS)
        for rid, out in final.items():
            if out.error is not None:
                assert isinstance(out.error, ExpertLoadError) and path.name in str(out.error)
            else:  # never a different answer
                assert _answer(out) == solo[rid[1:]], rid
    finally:
        engine.close()
