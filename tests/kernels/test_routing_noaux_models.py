"""Whole tiny DeepSeek-V3 and GLM-4.5 models with the C++ kernels, routed by the C++ noaux_tc op
(moe.CppSigmoidGroups) and by the torch ops (moe.SigmoidGroups, forced in the same engine build): every step's
logits equal, so the tokens and log-probabilities are equal, in default bf16 and in fp32, three prompts decoded
together (prefill rows and decode rows both routed)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.models import model as model_module
from moeserve.models.experts.moe import CppSigmoidGroups, SigmoidGroups, choose_routing
from tests.kernels.ops import cpp_ops
from tests.logits_capture import generate_capturing_logits
from tests.models.test_deepseek_v3 import write_tiny


@pytest.fixture(autouse=True)
def _kernels() -> None:
    cpp_ops()  # each test skips where the C++ kernels are unavailable; built at the first test, not at collection


PROMPTS = [[3, 17, 42, 9, 250, 100, 77, 5, 40, 12, 8, 8, 61], [11, 5, 77], [200, 1, 2, 3, 4, 5, 6, 7]]


def run(folder: Path, torch_routing: bool, dtype: str, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """(logits of each step, outputs, the routing classes the model built) with kernels=cpp."""
    built: list[type] = []

    def choose(spec, numerics, bias, *rest):  # noqa: ANN001, ANN002, ANN202 - moe.choose_routing's signature
        routing = choose_routing(spec, replace(numerics, cpp=numerics.cpp and not torch_routing), bias, *rest)
        built.append(type(routing))
        return routing

    monkeypatch.setattr(model_module, "choose_routing", choose)
    llm = LLM(str(folder), skip_tokenizer_init=True, kernels="cpp", dtype=dtype, max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
    logits, outs = generate_capturing_logits(llm, [{"prompt_token_ids": p} for p in PROMPTS], params)
    return logits, outs, built


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {"deepseek_v3": write_tiny(tmp_path_factory.mktemp("dsv3"), torch.bfloat16)}


@pytest.mark.slow  # ~14 s a case (two engine builds)
@pytest.mark.parametrize("dtype", ["auto", "float32"])
@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_cpp_routing_equals_torch_routing_in_the_whole_model(arch: str, dtype: str, folders, tiny_checkpoint,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    folder = folders[arch] if arch == "deepseek_v3" else tiny_checkpoint(arch, "bfloat16")
    cpp_logits, cpp_outs, cpp_built = run(folder, False, dtype, monkeypatch)
    torch_logits, torch_outs, torch_built = run(folder, True, dtype, monkeypatch)
    assert cpp_built and set(cpp_built) == {CppSigmoidGroups} and set(torch_built) == {SigmoidGroups}
    assert len(cpp_logits) == len(torch_logits)
    for a, b in zip(cpp_logits, torch_logits):
        assert torch.equal(a, b)
    for a, b in zip(cpp_outs, torch_outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
