"""GGUF experts at real dimensions (the checkpoints the other real-dims suites read, moeserve/bench/real_dims.py, 2
layers): Qwen3-30B-A3B's (hidden 2048, expert width 768, 12 experts) with gate Q8_0, up and down Q4_K (both types in
one file: one engine set), and gpt-oss-20b's (hidden 2880, expert width 2880, 6 experts, a sliding and a full layer)
with MXFP4 experts as llama.cpp ships them (gate and up apart; random blocks); the other matrices Q8_0, in default settings (bf16,
the C++ expert op reading the blocks as stored):

- offloaded (3 expert slots) == resident, every step's logits bit for bit;
- batched == alone: each prompt's logits in the steps of the prompts decoded together equal its run alone.
"""

from __future__ import annotations

import pytest
import torch

from tests.fixtures import gguf_gpt_oss
from tests.fixtures.gguf_files import write_gguf
from tests.models.exactness import assert_offloaded_equals_resident, run_alone, run_together

pytestmark = pytest.mark.slow  # the real-dims checkpoint (shared), its GGUF (10 s) and three engines (15 s)

PROMPTS = [[3, 17, 42, 9, 250, 1000, 77, 5, 4000, 12], [11, 5, 77]]
STEPS = 3


@pytest.mark.parametrize("model", ["Qwen3-30B-A3B", "gpt-oss-20b"])
def test_offloaded_equals_resident_and_batched_equals_alone(real_dims_checkpoint, tmp_path, model: str):
    if model == "gpt-oss-20b":
        gguf = gguf_gpt_oss.write_gguf(real_dims_checkpoint(model), tmp_path / "gpt-oss.gguf", "MXFP4", "Q8_0",
                                       random_blocks=True)
    else:
        types = {"gate": "Q8_0", "up": "Q4_K", "down": "Q4_K"}
        gguf = write_gguf(real_dims_checkpoint(model), tmp_path / "qwen3.gguf", types, "Q8_0")
    together = run_together(gguf, PROMPTS, STEPS)
    assert "cpp-q4-gguf" in together.choices["expert kernel"], together.choices
    assert_offloaded_equals_resident(gguf, PROMPTS, resident=together, steps=STEPS)
    alone = run_alone(gguf, PROMPTS, STEPS)
    assert len(together.logits) == STEPS  # one prefill step for both prompts, then one step per token
    for i in range(len(PROMPTS)):
        mine = alone.requests(i)
        assert together.outs[i] == mine.outs[0], f"request {i}: tokens or logprobs batched vs alone"
        for step, (both, one) in enumerate(zip(together.logits, mine.logits, strict=True)):
            assert torch.equal(both[i], one[0]), f"request {i}: logits differ at step {step}"
