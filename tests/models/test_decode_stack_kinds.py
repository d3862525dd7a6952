"""The fused decode step on the layer kinds beyond Qwen3-MoE (csrc/decode_stack_ffn.cpp, decode_stack_mixers.cpp):
every step's logits torch.equal to the per-op pass in bf16 with default settings (batch-invariant), resident and
offloaded with some experts not cached, at batch 1 and for sequences of different lengths side by side; the kinds
not taken are refused with the first reason (why_not_fused)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moeserve.engine.llm import LLM
from moeserve.engine.sampling_params import SamplingParams
from tests.kernels.ops import cpp_ops
from tests.logits_capture import generate_capturing_logits
from tests.models.test_deepseek_v3 import VARIANTS, write_tiny

BATCH_1 = [{"prompt_token_ids": [3, 17, 42, 9, 250, 8, 1, 77, 5]}]
# Three sequences of different lengths decode side by side (a batch of 3 at different positions).
BATCH_3 = [{"prompt_token_ids": [3, 17, 42, 9, 250, 8, 1, 77]}, {"prompt_token_ids": [11, 5, 77]},
           {"prompt_token_ids": [200, 4, 4, 19, 33]}]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def interleaved_ok() -> None:
    if not bool(cpp_ops().moe_interleaved_supported()):
        pytest.skip("the kernels were built without AVX512-BF16")


def run(folder: Path, decode_step: str, prompts: list, **settings):  # noqa: ANN201
    """(whether the fused step was chosen, every step's logits, tokens, fused steps run, each layer's (hits, misses,
    bytes read))."""
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="bfloat16", decode_step=decode_step, **settings)
    model = llm.engine.model
    chosen = model.decode_step is not None  # asked before the run (a closed engine's model holds no step)
    steps = [0]
    if model.decode_step is not None:
        fused_run = model.decode_step.run

        def counting(*a):  # noqa: ANN002, ANN202
            steps[0] += 1
            return fused_run(*a)

        model.decode_step.run = counting
    logits, outs = generate_capturing_logits(llm, prompts, PARAMS)
    traffic = {layer: (s.hits, s.misses, s.bytes_read) for layer, s in model.store.stats.layers.items()}
    return chosen, logits, [o.outputs[0].token_ids for o in outs], steps[0], traffic


def assert_fused_equals_per_op(folder: Path, prompts: list, **settings) -> dict:
    fused, logits, tokens, steps, traffic = run(folder, "fused", prompts, **settings)
    per_op, ref_logits, ref_tokens, ref_steps, ref_traffic = run(folder, "per_op", prompts, **settings)
    assert fused and not per_op
    assert steps == PARAMS.max_tokens - 1 and ref_steps == 0  # every decode step after the prefill ran fused
    assert tokens == ref_tokens
    assert len(logits) == len(ref_logits) and all(torch.equal(a, b) for a, b in zip(logits, ref_logits))
    assert traffic == ref_traffic
    return traffic


_SHAPE_FOLDERS: dict[str, Path] = {}  # the checkpoints not in conftest's tiny_checkpoint, written once per session


def tiny_shape(name: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from moeserve.bench.shapes import SHAPES
    from moeserve.bench.synth import ensure_checkpoint

    if name not in _SHAPE_FOLDERS:
        _SHAPE_FOLDERS[name] = ensure_checkpoint(SHAPES[name], tmp_path_factory.mktemp(name))
    return _SHAPE_FOLDERS[name]


# Checkpoints: glm4_moe = a dense first layer, noaux_tc routing in 2 groups, 2 plain shared experts, per-head q/k
# norm, qkv biases, partial rotary; qwen2_moe = a shared expert with its sigmoid gate; qwen3_next and the hybrid
# bench shape's tiny variant = 3 Gated DeltaNet layers : 1 gated full-attention layer (zero-centred q/k norm), a
# gated shared expert; deepseek_v3 (tests/models/test_deepseek_v3.py's tiny model) and the MLA bench shape's tiny
# variant = latent attention (q_lora, interleaved rope; or no q_lora, yarn, half-split rope and biases), noaux_tc,
# shared experts, a dense first layer. (Widths the C++ GEMV takes, 32-element multiples, where conftest's are not:
# a shared expert of 48 is refused, tested below.) A cache of 6e-5 GB holds ~5 of their units: some experts are
# not cached.
SHARED_64 = {"shared_expert_intermediate_size": 64}
DSV3_32 = {"q_lora_rank": 32, "v_head_dim": 8}
KINDS = {"glm4_moe": {}, "qwen2_moe": SHARED_64, "qwen3_next": SHARED_64, "hybrid-tiny": {}, "deepseek_v3": DSV3_32,
         "deepseek_v3-no-q-lora": {**DSV3_32, **VARIANTS["no-q-lora-yarn"], "rope_interleave": False,
                                   "attention_bias": True},
         "mla-tiny": {}}
CACHE_GB = 6e-5


def checkpoint(name: str, tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: ANN001
    if name.endswith("-tiny"):
        return tiny_shape(name, tmp_path_factory)
    if name.startswith("deepseek_v3"):
        if name not in _SHAPE_FOLDERS:
            _SHAPE_FOLDERS[name] = write_tiny(tmp_path_factory.mktemp(name), **KINDS[name])
        return _SHAPE_FOLDERS[name]
    return tiny_checkpoint(name, **KINDS[name])


@pytest.mark.parametrize("name", KINDS)
@pytest.mark.parametrize("prompts", [BATCH_1, BATCH_3], ids=["batch1", "batch3"])
@pytest.mark.parametrize("offloaded", [False, True], ids=["resident", "offloaded"])
def test_fused_step_gives_the_per_op_logits(interleaved_ok, tiny_checkpoint, tmp_path_factory, name, prompts,
                                            offloaded):
    settings = {"expert_cache_gb": CACHE_GB} if offloaded else {}
    traffic = assert_fused_equals_per_op(checkpoint(name, tiny_checkpoint, tmp_path_factory), prompts, **settings)
    assert sum(m for _, m, _ in traffic.values()) > 0 if offloaded else sum(h for h, _, _ in traffic.values()) > 0


@pytest.mark.parametrize("name,why", [
    ("qwen2_moe", "'onednn' layout"),  # its shared expert's down_proj takes 48 inputs
])
def test_kinds_not_taken_name_the_first_reason(interleaved_ok, tiny_checkpoint, tmp_path_factory, name, why):
    folder = tiny_shape(name, tmp_path_factory) if name.endswith("-tiny") else tiny_checkpoint(name)
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="bfloat16")
    try:
        assert llm.engine.model.decode_step is None
        assert why in dict(llm.engine.model.choices)["decode step"]
    finally:
        llm.engine.close()


@pytest.mark.parametrize("name", ["glm4_moe", "qwen3_next", "deepseek_v3"])
def test_int8_dense_linears_and_units(interleaved_ok, tiny_checkpoint, tmp_path_factory, name):
    """quantization=int8: the new parts' dense Linears (Gated DeltaNet's projections, MLA's, shared experts) and the
    expert units as int8 codes + row scales; the fused step gives the per-op logits."""
    if not bool(cpp_ops().moe_int8_interleaved_supported()):
        pytest.skip("the kernels were built without AVX512-BF16/VBMI")
    assert_fused_equals_per_op(checkpoint(name, tiny_checkpoint, tmp_path_factory), BATCH_3, quantization="int8")
