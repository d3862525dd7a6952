"""Experts held row-interleaved for the fused C++ op (bf16 with the kernels on): the engine chooses the layout,
its units are the plain experts permuted (nothing else), offloaded == resident bit for bit, and the answers agree
with the torch path on the plain layout."""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest
import torch

from moeserve.engine.llm import LLM
from moeserve.engine.sampling_params import SamplingParams
from moeserve.models.experts.kernels import CppInterleavedSwiGLU
from moeserve.models.experts.moe import MoEBlock
from moeserve.models.experts.sources import InterleavedExpertSource
from moeserve.models.experts.unit_math import InterleavedSwiGLU, SwiGLUMath, swiglu_expert
from moeserve.models.layers.linear import interleave_rows
from tests.kernels.ops import cpp_ops
from tests.logits_capture import generate_capturing_logits

PROMPTS = [{"prompt_token_ids": [3, 17, 42, 9, 250, 8, 1, 77]}, {"prompt_token_ids": [11, 5, 77]}]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def interleaved_ok():
    if not bool(cpp_ops().moe_interleaved_supported()):
        pytest.skip("the kernels were built without AVX512-BF16")


class Ran(NamedTuple):
    """What a test reads of an engine after its run (close() drops the model's layers, the store keeps its counts)."""

    kernel: Any  # the first MoE layer's expert kernel
    store: Any


def run(folder, **settings):
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="bfloat16", **settings)
    ran = Ran(expert_kernel(llm.engine), llm.engine.model.store)
    logits, outs = generate_capturing_logits(llm, PROMPTS, PARAMS)  # closes the engine
    return ran, logits, [o.outputs[0].token_ids for o in outs]


def expert_kernel(engine):
    return next(layer.mlp.experts for layer in engine.model.layers if isinstance(layer.mlp, MoEBlock))


def moe_kernel(ran):
    """The units' reference math (the plan's UnitMath)."""
    return ran.kernel.math


@pytest.mark.parametrize("cache_experts,prefetch", [(3, False), (1, True)])
def test_offloaded_equals_resident_with_interleaved_units(interleaved_ok, tiny_checkpoint, cache_experts, prefetch):
    folder = tiny_checkpoint("qwen3_moe")
    resident, ref_logits, ref_tokens = run(folder)
    assert isinstance(moe_kernel(resident), InterleavedSwiGLU) and resident.store.resident
    unit = resident.store.unit_nbytes
    offloaded, logits, tokens = run(folder, expert_cache_gb=cache_experts * unit / 2**30, prefetch=prefetch,
                                    expert_layout="interleaved")  # auto keeps offloaded bf16 experts plain
    assert isinstance(moe_kernel(offloaded), InterleavedSwiGLU)
    assert not offloaded.store.resident and offloaded.store.stats.misses > 0
    assert tokens == ref_tokens
    assert len(logits) == len(ref_logits) and all(torch.equal(a, b) for a, b in zip(logits, ref_logits))


def test_interleaved_answers_match_the_torch_path(interleaved_ok, tiny_checkpoint):
    folder = tiny_checkpoint("qwen3_moe")
    fast, fast_logits, _ = run(folder)
    plain, plain_logits, _ = run(folder, kernels="torch")
    assert isinstance(moe_kernel(fast), InterleavedSwiGLU) and isinstance(moe_kernel(plain), SwiGLUMath)
    # different kernels (dot products summed in another order): bf16-level agreement, step by step (the
    # prefill step and the first decode step see the same inputs in both runs)
    for a, b in zip(fast_logits[:2], plain_logits[:2]):
        assert (a - b).abs().max().item() <= 0.05 * b.abs().max().item()


def test_units_are_the_plain_experts_interleaved(interleaved_ok, tiny_checkpoint):
    folder = tiny_checkpoint("qwen3_moe")
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="bfloat16", expert_cache_gb=1e-6,
              expert_layout="interleaved")  # units come through the source
    try:
        check_units(llm.engine)
    finally:
        llm.engine.close()


def check_units(engine):
    source = engine.model.store.source
    assert isinstance(source, InterleavedExpertSource)
    layer, expert = 2, 5
    unit = torch.empty(source.layout.nbytes, dtype=torch.uint8)
    source.read_unit(layer, expert, unit)
    plain = torch.empty(source.dense_source.layout.nbytes, dtype=torch.uint8)
    source.dense_source.read_unit(layer, expert, plain)
    (gu, dn), (pgu, pdn) = source.layout.views(unit), source.dense_source.layout.views(plain)
    assert torch.equal(gu, interleave_rows(pgu)) and torch.equal(dn, interleave_rows(pdn))
    x = torch.randn(3, pgu.shape[1]).bfloat16()
    kernel = expert_kernel(engine).math
    assert torch.equal(kernel(x, (gu, dn)), swiglu_expert(x, (pgu, pdn)))  # the slow reference path agrees


def test_expert_layout_setting(interleaved_ok, tiny_checkpoint):
    from moeserve.errors import ConfigError

    folder = tiny_checkpoint("qwen3_moe")
    plain, plain_logits, _ = run(folder, expert_layout="plain")
    assert isinstance(moe_kernel(plain), SwiGLUMath)  # the plain-layout fused op (decode) and torch loop (prefill)
    forced, forced_logits, _ = run(folder, expert_layout="interleaved")
    assert isinstance(moe_kernel(forced), InterleavedSwiGLU)
    assert (forced_logits[0] - plain_logits[0]).abs().max().item() <= 0.05 * plain_logits[0].abs().max().item()
    with pytest.raises(ConfigError, match="expert_layout=interleaved is not possible here"):
        LLM(str(folder), skip_tokenizer_init=True, dtype="float32", expert_layout="interleaved")


def test_auto_layout_interleaves_offloaded_experts_as_resident_ones(interleaved_ok, tiny_checkpoint, tmp_path):
    """The layout (and so the op, and its rounding) never follows the placement: offloaded bf16 and int8 experts
    are interleaved under auto as resident ones are (misses are permuted as they are read)."""
    folder = tiny_checkpoint("qwen3_moe")
    bf16, _, _ = run(folder, expert_cache_gb=1e-6)
    assert isinstance(bf16.kernel, CppInterleavedSwiGLU) and not bf16.store.resident
    if bool(cpp_ops().moe_int8_interleaved_supported()):
        int8, _, _ = run(folder, expert_cache_gb=1e-6, quantization="int8", int8_cache_dir=str(tmp_path))
        assert isinstance(int8.kernel, CppInterleavedSwiGLU) and not int8.store.resident
