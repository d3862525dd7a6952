"""The fused decode step (every layer in one C++ call, models/decode_stack.py) gives the per-op path's exact logits,
keeps the store's hit counts, and is chosen (and refused) with a logged reason."""

from __future__ import annotations

import re

import pytest
import torch

from moeserve.engine.llm import LLM
from moeserve.engine.sampling_params import SamplingParams
from moeserve.errors import ConfigError
from moeserve.models.decode_stack import choose_decode_step
from tests.kernels.ops import cpp_ops
from tests.logits_capture import generate_capturing_logits

# Two sequences of different lengths decode side by side (a batch of 2 at different positions).
PROMPTS = [{"prompt_token_ids": [3, 17, 42, 9, 250, 8, 1, 77]}, {"prompt_token_ids": [11, 5, 77]}]
PARAMS = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def interleaved_ok():
    if not bool(cpp_ops().moe_interleaved_supported()):
        pytest.skip("the kernels were built without AVX512-BF16")


def run(folder, decode_step: str, **settings):
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="bfloat16", decode_step=decode_step, **settings)
    model = llm.engine.model
    model.fused_chosen = model.decode_step is not None  # asked before the run (a closed engine's model has no step)
    fused_steps = 0
    if model.decode_step is not None:
        fused_step = model.decode_step.run

        def counting(*a):  # noqa: ANN002, ANN202
            nonlocal fused_steps
            fused_steps += 1
            return fused_step(*a)

        model.decode_step.run = counting
    model.calls_run_in_stack = 0  # layer calls the stack ran on cached units and reported (report_cached_calls)
    report = model.store.report_cached_calls

    def reporting(log=(), hits_per_layer=()):  # noqa: ANN001, ANN202
        i = 0
        while i < len(log):
            model.calls_run_in_stack, i = model.calls_run_in_stack + 1, i + 2 + log[i + 1]
        report(log, hits_per_layer)

    model.store.report_cached_calls = reporting
    logits, outs = generate_capturing_logits(llm, PROMPTS, PARAMS)
    hits = {layer: (s.hits, s.misses, s.bytes_read) for layer, s in model.store.stats.layers.items()}
    return model, logits, [o.outputs[0].token_ids for o in outs], fused_steps, hits


@pytest.mark.parametrize("arch,overrides,quantization", [
    ("qwen3_moe", {}, "none"),  # per-head q/k norm, a dense MLP layer (mlp_only_layers=[1])
    ("qwen3_moe", {}, "int8"),  # int8 units and int8 dense Linears
    ("mixtral", {"sliding_window": 4}, "none"),  # a window shorter than the prompts
])
def test_fused_step_gives_the_per_op_logits(interleaved_ok, tiny_checkpoint, arch, overrides, quantization):
    if quantization == "int8" and not bool(cpp_ops().moe_int8_interleaved_supported()):
        pytest.skip("the kernels were built without AVX512-BF16/VBMI")
    folder = tiny_checkpoint(arch, **overrides)
    fused, logits, tokens, steps, hits = run(folder, "fused", quantization=quantization)
    per_op, ref_logits, ref_tokens, ref_steps, ref_hits = run(folder, "per_op", quantization=quantization)
    assert fused.fused_chosen and not per_op.fused_chosen
    assert steps == PARAMS.max_tokens - 1 and ref_steps == 0  # every decode step after the prefill
    assert tokens == ref_tokens
    assert len(logits) == len(ref_logits) and all(torch.equal(a, b) for a, b in zip(logits, ref_logits))
    assert hits == ref_hits and sum(h for h, _, _ in hits.values()) > 0


@pytest.mark.parametrize("quantization,layout,cache_gb", [
    ("none", "auto", 1e-6),  # offloaded bf16 under auto: plain units (moe_swiglu_); a 1-unit cache: 1 per chunk
    ("none", "interleaved", 1e-6),
    ("none", "auto", 6e-5),  # 5 of 16 units: hits and misses in one layer call
    ("int8", "auto", 3e-5),
    ("int8", "plain", 3e-5),
    ("none", "auto", 1.7e-4),  # 14 of 16 units: most layer calls all cached, run in the stack without stopping
])
def test_offloaded_fused_step_gives_the_per_op_logits_and_store_traffic(interleaved_ok, tiny_checkpoint,
                                                                        quantization, layout, cache_gb):
    """Offloaded: the stack stops at each MoE layer and the store yields the units (in chunks when the cache is
    smaller than the layer's needs); logits, tokens and every layer's hits, misses and bytes read are the per-op
    path's."""
    if quantization == "int8" and not bool(cpp_ops().moe_int8_interleaved_supported()):
        pytest.skip("the kernels were built without AVX512-BF16/VBMI")
    folder = tiny_checkpoint("qwen3_moe")
    settings = dict(quantization=quantization, expert_layout=layout, expert_cache_gb=cache_gb)
    fused, logits, tokens, steps, traffic = run(folder, "fused", **settings)
    per_op, ref_logits, ref_tokens, ref_steps, ref_traffic = run(folder, "per_op", **settings)
    assert not fused.store.resident and fused.fused_chosen and not per_op.fused_chosen
    assert "stopping at a MoE layer only when the store must read" in dict(fused.choices)["decode step"]
    assert steps == PARAMS.max_tokens - 1 and ref_steps == 0
    assert tokens == ref_tokens
    assert len(logits) == len(ref_logits) and all(torch.equal(a, b) for a, b in zip(logits, ref_logits))
    assert traffic == ref_traffic
    assert sum(m for _, m, _ in traffic.values()) > 0  # the cache really missed
    # The same units end up cached (the policy heard the same calls), and the C++ slot table mirrors the store's map.
    assert fused.store.cached_keys() == per_op.store.cached_keys()
    for store in (fused.store, per_op.store):
        rows = store.slot_table.tolist()
        assert {(store.layers[i], e): s for i, row in enumerate(rows) for e, s in enumerate(row) if s >= 0} == \
            store.cache.slot_map()
    if fused.store.capacity >= 5:  # some layer calls found every expert cached and ran in the stack
        assert fused.calls_run_in_stack > 0



def test_auto_chooses_with_a_reason(interleaved_ok, tiny_checkpoint):
    folder = tiny_checkpoint("qwen3_moe")
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="bfloat16")
    model = llm.engine.model
    assert model.decode_step is not None
    assert "one C++ call" in dict(model.choices)["decode step"]
    step, reason = choose_decode_step(model, "per_op")
    assert "per_op, set" in reason and step is None
    llm.engine.close()


@pytest.mark.parametrize("settings,why", [
    ({"kernels": "torch"}, "C++ kernels are off"),
    ({"expert_layout": "plain"}, "not row-interleaved"),
    ({"dtype": "float32"}, "bf16 on CPU"),
])
def test_fused_refused_where_it_cannot_apply(interleaved_ok, tiny_checkpoint, settings, why):
    folder = tiny_checkpoint("qwen3_moe")
    with pytest.raises(ConfigError, match=re.escape(why)):
        LLM(str(folder), skip_tokenizer_init=True, **{"dtype": "bfloat16", **settings, "decode_step": "fused"})
    llm = LLM(str(folder), skip_tokenizer_init=True, **{"dtype": "bfloat16", **settings})  # auto: per op
    assert llm.engine.model.decode_step is None
    llm.engine.close()


def test_full_qk_norm_runs_per_op(interleaved_ok, tiny_checkpoint):
    """(Shared experts, noaux_tc routing and the other new kinds: tests/models/test_decode_stack_kinds.py.)"""
    llm = LLM(str(tiny_checkpoint("olmoe")), skip_tokenizer_init=True, dtype="bfloat16")
    assert llm.engine.model.decode_step is None
    assert "full-width q/k norm" in dict(llm.engine.model.choices)["decode step"]
    llm.engine.close()
