"""GGUF models end to end, on tiny GGUFs written from transformers checkpoints (tests/fixtures/gguf_files.py): the
experts in every ggml type moeserve reads (a layer's gate, up and down in different types), the other matrices in a
quantized type (dequantized at load), llama's permuted q/k rows, qwen2moe's shared expert and biases, OLMoE's
full-width q/k norms.

- fp32: moeserve's logits of every step on the GGUF equal, bit for bit, its logits on the same weights dequantized by
  the gguf package's reference `dequantize` and saved as float32 safetensors (so every byte is decoded as llama.cpp's
  own Python reference decodes it, and nothing of the GGUF path changes the math). Both with kernels=torch: in fp32
  the dense experts run the C++ SwiGLU op, which the dequantizing kernel does not call (it runs the torch math of
  the same units), so the two would differ by the op's summation order, not by a weight;
- fp32: greedy tokens equal transformers' on those dequantized weights (log-probabilities within 1e-4);
- default settings (bf16): offloaded == resident, bit for bit, with experts kept in their ggml type in every tier,
  and a miss reads exactly one expert's stored blocks.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from moeserve.bench.checkpoints import write_tiny_checkpoint
from moeserve.checkpoint.folder import open_checkpoint
from tests.engine.test_parity_transformers import hf_greedy
from tests.fixtures.gguf_files import write_gguf, write_reference
from tests.models.exactness import (
    assert_a_miss_reads_one_expert,
    assert_offloaded_equals_resident,
    assert_same_run,
    random_prompts,
    run_together,
)

K_DIMS = {"hidden_size": 256, "moe_intermediate_size": 256, "intermediate_size": 256, "num_experts": 4,
          "num_hidden_layers": 2, "mlp_only_layers": []}  # K-quant rows hold whole 256-value blocks
# case -> (tiny architecture, expert types, other matrices' type, config overrides)
CASES = {
    "qwen3moe-k-quants": ("qwen3_moe", {"gate": "Q4_K", "up": "Q5_K", "down": "Q6_K"}, "Q8_0", K_DIMS),
    # llama.cpp's Q4_K_M mix: a projection's type changes across layers (units sized for the widest)
    "qwen3moe-down-q6_k-then-q4_k": ("qwen3_moe", {"gate": "Q4_K", "up": "Q5_K", "down": "Q6_K", "1.down": "Q4_K"},
                                     "Q8_0", K_DIMS),
    "mixtral-q8_0-q4_0-mxfp4": ("mixtral", {"gate": "Q8_0", "up": "Q4_0", "down": "MXFP4"}, "Q4_0", {}),
    "qwen2moe-f16": ("qwen2_moe", "F16", "Q8_0", {}),
    "olmoe-bf16": ("olmoe", "BF16", "BF16", {}),
}
PROMPTS = random_prompts(7, (5, 11))
STEPS = 5


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("gguf_models")

    @functools.cache
    def make(case: str) -> tuple[Path, Path]:
        arch, experts, dense, overrides = CASES[case]
        src = write_tiny_checkpoint(root / f"{case}-src", arch, "float32", 0, **overrides)
        gguf = write_gguf(src, root / f"{case}.gguf", experts, dense)
        return gguf, write_reference(src, experts, dense, root / f"{case}-ref")

    return make


@pytest.mark.parametrize("case", list(CASES))
def test_fp32_logits_equal_the_dequantized_checkpoint_and_tokens_equal_transformers(files, case: str) -> None:
    from transformers import AutoModelForCausalLM

    gguf, ref = files(case)
    got = run_together(gguf, PROMPTS, STEPS, dtype="float32", kernels="torch")
    assert_same_run(got, run_together(ref, PROMPTS, STEPS, dtype="float32", kernels="torch"),
                    f"{case}: GGUF vs dequantized")
    hf = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    for prompt, (tokens, logprobs) in zip(PROMPTS, got.outs, strict=True):
        ref_tokens, ref_logps = hf_greedy(hf, prompt, STEPS)
        assert tokens == ref_tokens, (case, len(prompt))
        for lp, ref_lp in zip(logprobs, ref_logps, strict=True):
            for token_id, entry in lp.items():
                assert abs(entry.logprob - float(ref_lp[token_id])) < 1e-4, (case, token_id)


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][1] not in ("F16", "BF16")])
def test_offloaded_equals_resident_with_experts_in_their_ggml_type(files, case: str) -> None:
    gguf, _ = files(case)
    run = assert_offloaded_equals_resident(gguf, PROMPTS, steps=STEPS)
    assert "stored as gguf-" in run.choices["experts"], run.choices["experts"]
    ckpt = open_checkpoint(gguf)
    expert = next(n for n in ckpt.tensors if ".experts.0." in n).split(".experts.0.")[0] + ".experts.0."
    assert expert.startswith("model.layers.0."), expert
    stored = assert_a_miss_reads_one_expert(gguf, PROMPTS[:1], expert.replace(".0.", ".{L}.", 1))
    types = ckpt.config["quantization_config"]["tensor_types"]
    assert stored == sum(r.nbytes for n, r in ckpt.tensors.items() if n.startswith(expert))
    if "then" in case:  # the down projection's type changes across layers: units sized for the widest
        assert "the ggml type of down changes across layers" in run.choices["experts"], run.choices["experts"]
    assert len(set(types.values())) == 3  # gate, up and down each in their own type, as stored
