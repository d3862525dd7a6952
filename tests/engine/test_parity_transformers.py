"""Greedy tokens and log-probabilities against Hugging Face transformers on checkpoints it wrote itself.

For each architecture and dtype: several prompts of different lengths decoded together in one batch must give,
for at least 16 steps, the same tokens as transformers' greedy decoding of each prompt, and (float32) the same
log-probabilities within 1e-4 at every step.
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.bench.checkpoints import ARCHS

STEPS = 16
PROMPTS = [[5], [11, 42, 7, 99, 3], [17, 250, 33, 4, 8, 120, 64, 2, 77, 45, 13, 200], list(range(40, 63))]


# The reference is transformers' decode, most of these tests' time (a tiny Qwen3-Next: 24 s of transformers against
# 7 s of ours), and the same for the kernels=auto and kernels=torch cases of a test, which run one after the other.
# So the last model loaded is kept (same folder, same files, same dtype: the same model) with the greedy runs made
# on it, until the next model or the test function's last case (conftest.py: forget_transformers_models); each case
# still compares its own engine's output with transformers' numbers, computed the same way.
_LAST_MODEL: dict[tuple[Any, ...], Any] = {}
_GREEDY: weakref.WeakKeyDictionary[Any, dict[tuple[tuple[int, ...], int], tuple[list[int], list[torch.Tensor]]]] = \
    weakref.WeakKeyDictionary()


def hf_model(folder, dtype: torch.dtype):  # noqa: ANN001, ANN201 - a folder path; a transformers model
    from transformers import AutoModelForCausalLM

    files = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(Path(folder).iterdir()))
    key = (str(folder), dtype, files)
    if key not in _LAST_MODEL:
        forget_transformers_models()
        _LAST_MODEL[key] = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    return _LAST_MODEL[key]


def forget_transformers_models() -> None:
    _LAST_MODEL.clear()


def hf_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:  # noqa: ANN001
    """transformers' own forward, no cache: argmax token and the full log-softmax at each step (made once per
    model, prompt and step count: see _LAST_MODEL)."""
    runs = _GREEDY.setdefault(model, {})
    key = (tuple(prompt), steps)
    if key not in runs:
        ids, logps = list(prompt), []
        with torch.no_grad():
            for _ in range(steps):
                logits = model(torch.tensor([ids])).logits[0, -1].float()
                logps.append(torch.log_softmax(logits, dim=-1))
                ids.append(int(torch.argmax(logits)))
        runs[key] = (ids[len(prompt):], logps)
    tokens, logps = runs[key]
    return list(tokens), list(logps)


@pytest.mark.parametrize("kernels", ["auto", "torch"])  # auto: the C++ ops where they build; torch: never
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batched_greedy_matches_transformers(tiny_checkpoint, arch: str, dtype: str, kernels: str) -> None:
    folder = tiny_checkpoint(arch, dtype)
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype=dtype, kernels=kernels)
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    # bfloat16 keeps 8 significant bits: the two engines round differently inside the GEMMs, and at |logit| in
    # [32, 64) one bf16 step is 0.25, so two steps is the honest tolerance there.
    tol = 1e-4 if dtype == "float32" else 0.5
    ref_model = hf_model(folder, getattr(torch, dtype))
    for prompt, out in zip(PROMPTS, outs):
        ours = out.outputs[0]
        ref_tokens, ref_logps = hf_greedy(ref_model, prompt, STEPS)
        if dtype == "bfloat16":
            # bf16 rounding may flip a near-tie; the sequences may then part, but only at a near-tie.
            steps = _matching_prefix(ours.token_ids, ref_tokens)
            if steps < STEPS:
                ref = ref_logps[steps]
                gap = float(ref[ref_tokens[steps]] - ref[ours.token_ids[steps]])
                assert gap < tol, f"{arch} bf16 diverged at step {steps} where the margin was {gap:.3f}"
            ours.logprobs = ours.logprobs[:steps]
        else:
            assert ours.token_ids == ref_tokens, f"{arch} {dtype} prompt len {len(prompt)}"
        assert ours.finish_reason == "length"
        for step, (lp, ref) in enumerate(zip(ours.logprobs, ref_logps)):
            if dtype == "float32":  # in bf16 near-ties at rank 5 may order differently; values are checked below
                top_ref = torch.topk(ref, 5)
                assert set(lp) >= set(top_ref.indices.tolist()), f"step {step}: top-5 ids differ"
            for token_id, entry in lp.items():
                assert abs(entry.logprob - float(ref[token_id])) < tol, (arch, dtype, step, token_id)


def _matching_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_batch_equals_each_prompt_alone(tiny_checkpoint, arch: str) -> None:
    llm = LLM(str(tiny_checkpoint(arch)), skip_tokenizer_init=True, dtype="float32", max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    batched = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, out in zip(PROMPTS, batched):
        alone = llm.generate({"prompt_token_ids": prompt}, params)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids


def test_more_prompts_than_slots_all_finish(tiny_checkpoint) -> None:
    """Continuous batching: requests wait for a free KV slot, then join the running batch."""
    llm = LLM(str(tiny_checkpoint("qwen3_moe")), skip_tokenizer_init=True, dtype="float32", max_num_seqs=2)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS * 2], params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [5] * 8
    assert outs[0].outputs[0].token_ids == outs[4].outputs[0].token_ids


def test_dense_layer_and_sparse_step_are_honoured(tiny_checkpoint) -> None:
    """Qwen3-MoE with decoder_sparse_step=2: layers 0 and 2 dense by the step rule, 1 sparse."""
    folder = tiny_checkpoint("qwen3_moe", mlp_only_layers=[], decoder_sparse_step=2)
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32")
    assert llm.engine.spec.moe_layers == (False, True, False)
    out = llm.generate({"prompt_token_ids": PROMPTS[2]}, SamplingParams(temperature=0, max_tokens=STEPS,
                                                                          ignore_eos=True))
    ref, _ = hf_greedy(hf_model(folder, torch.float32), PROMPTS[2], STEPS)
    assert out[0].outputs[0].token_ids == ref


# Other shapes: each exercises a switch the base configs leave off.
VARIANTS = {
    "qwen3_tied_mqa_top4": ("qwen3_moe", dict(tie_word_embeddings=True, num_key_value_heads=1, num_experts=16,
                                              num_experts_per_tok=4, norm_topk_prob=False, mlp_only_layers=[])),
    "mixtral_sliding_window": ("mixtral", dict(sliding_window=6)),
    "olmoe_clip_qkv_norm_topk": ("olmoe", dict(clip_qkv=0.5, norm_topk_prob=True)),
    "qwen2_sparse_step_2": ("qwen2_moe", dict(decoder_sparse_step=2, num_hidden_layers=3,
                                              shared_expert_intermediate_size=16)),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_shape_variants_match_transformers(tiny_checkpoint, variant: str) -> None:
    arch, overrides = VARIANTS[variant]
    assert_fp32_batch_matches_transformers(tiny_checkpoint(arch, **overrides), variant)


def assert_fp32_batch_matches_transformers(folder, what: str, **settings) -> None:  # noqa: ANN001
    """Two prompts (the second longer than a sliding window) decoded together in fp32: transformers' greedy
    tokens, and its log-probabilities within 1e-4 for the top tokens of every step."""
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", **settings)
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=3)
    prompts = [PROMPTS[1], PROMPTS[3]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    ref_model = hf_model(folder, torch.float32)
    for prompt, out in zip(prompts, outs):
        ref_tokens, ref_logps = hf_greedy(ref_model, prompt, STEPS)
        assert out.outputs[0].token_ids == ref_tokens, what
        for lp, ref in zip(out.outputs[0].logprobs, ref_logps):
            for token_id, entry in lp.items():
                assert abs(entry.logprob - float(ref[token_id])) < 1e-4, what


def test_float16_compute_matches_transformers_float16(tiny_checkpoint) -> None:
    folder = tiny_checkpoint("qwen3_moe")
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float16")
    out = llm.generate({"prompt_token_ids": PROMPTS[2]}, SamplingParams(temperature=0, max_tokens=STEPS,
                                                                          ignore_eos=True, logprobs=1))[0]
    ref_tokens, ref_logps = hf_greedy(hf_model(folder, torch.float16), PROMPTS[2], STEPS)
    steps = _matching_prefix(out.outputs[0].token_ids, ref_tokens)
    assert steps >= STEPS // 2  # fp16 keeps 11 significant bits: any parting must come late, at a near-tie
    for lp, ref in zip(out.outputs[0].logprobs[:steps], ref_logps):
        for token_id, entry in lp.items():
            assert abs(entry.logprob - float(ref[token_id])) < 0.05
