"""Interleaved SwiGLU units read from a checkpoint that stores the compute dtype: the permutation is the copy out of
the read buffer (O_DIRECT staging or a page-cache scratch), and the unit is exactly the plain expert's matrices
row-interleaved (torch reference `interleave_rows`); offloaded decode equals resident decode bit for bit."""

from __future__ import annotations

import pytest
import torch

from moeserve.engine.llm import LLM
from moeserve.engine.sampling_params import SamplingParams
from moeserve.models.experts.sources import InterleavedExpertSource
from moeserve.models.layers.linear import interleave_rows
from tests.kernels.ops import cpp_ops
from tests.logits_capture import generate_capturing_logits

PROMPTS = [{"prompt_token_ids": [3, 17, 42, 9, 250, 8, 1, 77]}, {"prompt_token_ids": [11, 5, 77]}]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def bf16_folder(tiny_checkpoint):
    if not bool(cpp_ops().moe_interleaved_supported()):
        pytest.skip("the kernels were built without AVX512-BF16")
    return tiny_checkpoint("qwen3_moe", "bfloat16")


def engine(folder, **settings):
    return LLM(str(folder), skip_tokenizer_init=True, dtype="bfloat16", **settings)


@pytest.mark.parametrize("direct", [True, False])
def test_placed_units_are_the_plain_experts_interleaved(bf16_folder, direct):
    llm = engine(bf16_folder, expert_cache_gb=1e-6, expert_layout="interleaved")
    source = llm.engine.model.store.source
    assert isinstance(source, InterleavedExpertSource) and source._placed
    assert source.per_thread_staging_nbytes == 0  # no scratch unit: the reader's buffer is the only one
    source.checkpoint.reader.direct = direct
    plain = torch.empty(source.dense_source.layout.nbytes, dtype=torch.uint8)
    unit = torch.empty(source.layout.nbytes, dtype=torch.uint8)
    keys = sorted(source.sources)
    for layer, expert in (keys[0], keys[len(keys) // 2], keys[-1]):
        unit.fill_(0xAB)
        source.read_unit(layer, expert, unit)
        source.dense_source.read_unit(layer, expert, plain)
        (gu, dn), (pgu, pdn) = source.layout.views(unit), source.dense_source.layout.views(plain)
        assert torch.equal(gu, interleave_rows(pgu)) and torch.equal(dn, interleave_rows(pdn))


@pytest.mark.parametrize("cache_experts,prefetch", [(3, False), (1, True)])
def test_offloaded_placed_units_decode_like_resident_ones(bf16_folder, cache_experts, prefetch):
    resident = engine(bf16_folder)
    ref_logits, ref_outs = generate_capturing_logits(resident, PROMPTS, PARAMS)
    unit = resident.engine.model.store.unit_nbytes
    offloaded = engine(bf16_folder, expert_cache_gb=cache_experts * unit / 2**30, prefetch=prefetch,
                       expert_layout="interleaved")
    assert isinstance(offloaded.engine.model.store.source, InterleavedExpertSource)
    logits, outs = generate_capturing_logits(offloaded, PROMPTS, PARAMS)
    assert offloaded.engine.model.store.stats.misses > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref_outs]
    assert len(logits) == len(ref_logits) and all(torch.equal(a, b) for a, b in zip(logits, ref_logits))
