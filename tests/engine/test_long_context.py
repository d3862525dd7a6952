"""The default context is the model's own: a 16k-token prompt runs with no setting but the model path, prefilled
in chunks of max_num_batched_tokens (2048 by default) while a short request that arrives meanwhile is admitted and
answered before the long prompt's prefill ends."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from moeserve.engine.llm import LLM
from moeserve.engine.llm_engine import demo_model_path
from moeserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model (tokenizer included) with a 32k context in its config."""
    folder = tmp_path_factory.mktemp("long") / "model"
    shutil.copytree(demo_model_path(), folder)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 32768
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_16k_prompt_runs_with_only_the_model_path(long_context_model: Path) -> None:
    llm = LLM(str(long_context_model))
    engine = llm.engine
    try:
        assert engine.max_model_len == 32768 and "max_position_embeddings" in engine.choices["max_model_len"]
        long_prompt = [(i * 7919) % 1000 + 10 for i in range(16384)]
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        engine.add_request(long_prompt, params, request_id="long")
        first = engine.step()  # the first chunk
        assert first == [] and engine.scheduler.stats.last_step_tokens == engine.max_num_batched_tokens == 2048
        engine.add_request([11, 12, 13, 14], params, request_id="short")
        finished: dict[str, int] = {}
        short_first_token_step = long_first_token_step = None
        step = 1
        while engine.has_unfinished_requests():
            step += 1
            for out in engine.step():
                if out.outputs[0].token_ids:
                    if out.request_id == "short" and short_first_token_step is None:
                        short_first_token_step = step
                    if out.request_id == "long" and long_first_token_step is None:
                        long_first_token_step = step
                if out.finished:
                    finished[out.request_id] = len(out.outputs[0].token_ids)
            assert engine.scheduler.stats.last_step_tokens <= 2048
        assert finished == {"long": 3, "short": 3}
        assert short_first_token_step == 2, "the short request is admitted at the next step, beside the chunks"
        assert long_first_token_step is not None and long_first_token_step >= 16384 // 2048
    finally:
        engine.close()
