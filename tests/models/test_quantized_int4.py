"""quantization="int4": experts of a 16-bit checkpoint quantized on load to compressed-tensors' pack-quantized int4
(symmetric, a bf16 scale per 32 inputs: formats/int4.quantize_int4_packed), int4 in every cache tier and read as
stored by the C++ 4-bit op (kernels=cpp); the dense Linears int8 as under quantization=int8. Offloading (misses read the spill file) must stay bit-exact; the accuracy
cost against the unquantized model is bounded on the first step (same context)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.bench.checkpoints import write_tiny_checkpoint
from moeserve.errors import ConfigError
from tests.fixtures import checkpoints as C
from tests.kernels.ops import cpp_ops

PROMPTS = [[5, 9], [17, 250, 33, 4, 8, 120, 64, 2, 77, 45, 13, 200]]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def bf16_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("int4")
    return {"qwen3_moe": write_tiny_checkpoint(root / "qwen3", "qwen3_moe", "bfloat16"),
            "gpt_oss": C.write_gpt_oss(root / "gpt_oss")}


def run(folder: Path, **settings):  # noqa: ANN201
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="bfloat16", **settings)
    outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)]
    return llm, outs


def logprob_table(out) -> list[dict[int, float]]:  # noqa: ANN001
    return [{t: e.logprob for t, e in lp.items()} for lp in out.logprobs]


@pytest.mark.slow  # four engines per architecture: 15 s at load 9
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_int4_experts_offloaded_equal_resident_through_the_4bit_op(bf16_folders, tmp_path: Path, arch: str) -> None:
    cpp_ops()  # skips where the C++ kernels are not available
    folder = bf16_folders[arch]
    _, dense = run(folder, kernels="cpp")
    resident_llm, resident = run(folder, kernels="cpp", quantization="int4")
    offloaded_llm, offloaded = run(folder, kernels="cpp", quantization="int4", expert_cache_gb=1e-9,
                                   int8_cache_dir=str(tmp_path / "spill"))
    kernel = resident_llm.engine.choices["expert kernel"]
    assert "cpp-q4-int4" in kernel, kernel
    model = resident_llm.engine.model  # the dense Linears as int8, as quantization=int8 makes them
    assert model.layers[0].attn.qkv.layout == "int8" and "int8" in dict(model.choices)["dense layers"]
    assert offloaded_llm.engine.model.store.stats.misses > 0
    for a, b in zip(offloaded, resident):
        assert a.token_ids == b.token_ids and logprob_table(a) == logprob_table(b)
    layout = resident_llm.engine.model.store.layout
    assert [f.dtype for f in layout.fields if f.name.endswith(".weight_scale")] == [torch.bfloat16] * 2
    # The C++ op and torch's per-call dequantization compute the same int4 weights (other dot orders; torch's path
    # keeps the dense Linears in bf16, the int8 dense GEMV being a C++ op): close
    _, via_torch = run(folder, kernels="torch", quantization="int4")
    assert max(_first_step_deviations(resident, via_torch)) < 0.05
    # Accuracy cost against bf16 on the first step (same context), tiny random models: under 0.25 nats (qwen3_moe),
    # 0.47 at most (gpt_oss) measured
    assert 0 < max(_first_step_deviations(resident, dense)) < 1.0


def _first_step_deviations(a, b) -> list[float]:  # noqa: ANN001
    return [abs(p[0][t] - q[0][t]) for ao, bo in zip(a, b)
            for p, q in [(logprob_table(ao), logprob_table(bo))] for t in set(p[0]) & set(q[0])]

def test_int4_refuses_an_already_quantized_checkpoint(bf16_folders, tmp_path: Path) -> None:
    quantized = C.write_gpt_oss_mxfp4(bf16_folders["gpt_oss"], tmp_path / "mxfp4")
    with pytest.raises(ConfigError, match="already quantized"):
        LLM(str(quantized), skip_tokenizer_init=True, quantization="int4")
