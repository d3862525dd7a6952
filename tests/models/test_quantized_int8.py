"""quantization="int8": experts of a 16-bit checkpoint quantized on load (per-row scales), int8 in every cache
tier, dequantized at use. Offloading must stay bit-exact; the accuracy cost is measured against the unquantized
model (first-step logprobs, same context)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.errors import ConfigError
from tests.conftest import write_tiny_checkpoint
from tests.models import checkpoints as C

PROMPTS = [[5, 9], [17, 250, 33, 4, 8, 120, 64, 2, 77, 45, 13, 200]]
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def bf16_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("int8")
    return {
        "qwen3_moe": write_tiny_checkpoint(root / "qwen3", "qwen3_moe", "bfloat16"),
        "gpt_oss": C.write_gpt_oss(root / "gpt_oss"),
    }


def run(folder: Path, **settings):
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", **settings)
    outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)]
    return llm, outs


def logprob_table(out) -> list[dict[int, float]]:
    return [{t: e.logprob for t, e in lp.items()} for lp in out.logprobs]


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_int8_experts_offloaded_equal_resident_and_cost_little_accuracy(bf16_folders, arch: str) -> None:
    folder = bf16_folders[arch]
    dense_llm, dense = run(folder)
    int8_llm, resident = run(folder, quantization="int8")
    offloaded_llm, offloaded = run(folder, quantization="int8", expert_cache_gb=1e-9)
    assert offloaded_llm.engine.model.store.stats.misses > 0
    for a, b in zip(offloaded, resident):
        assert a.token_ids == b.token_ids and logprob_table(a) == logprob_table(b)
    layout = int8_llm.engine.model.store.layout
    matrices = [f for f in layout.fields if len(f.shape) == 2]
    assert matrices and all(f.dtype == torch.int8 for f in matrices)
    assert layout.nbytes < dense_llm.engine.model.store.layout.nbytes / 3  # int8 + scales vs float32 units
    # Accuracy cost on the first step (same context for both): measured ~0.01 nats on these tiny models.
    deviations = [
        abs(q[0][t] - d[0][t])
        for qo, do in zip(resident, dense)
        for q, d in [(logprob_table(qo), logprob_table(do))]
        for t in set(q[0]) & set(d[0])
    ]
    assert 0 < max(deviations) < 0.05


def test_int8_refuses_an_already_quantized_checkpoint(bf16_folders, tmp_path: Path) -> None:
    quantized = C.write_gpt_oss_mxfp4(bf16_folders["gpt_oss"], tmp_path / "mxfp4")
    with pytest.raises(ConfigError, match="already quantized"):
        LLM(str(quantized), skip_tokenizer_init=True, quantization="int8")
