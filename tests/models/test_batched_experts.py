"""The batched expert kernel (models/experts/kernels.BatchedExperts, the GPU's): run on the CPU here.

- kernel level, random SwiGLU units: within float32 rounding of the per-expert loop; bf16 results bit-identical
  whatever the chunking of the layer's experts (resident = one chunk, offloaded = chunks of any size) and, in
  batch-invariant mode, whatever the other tokens; the ordered add equals the loop's adds bit for bit;
- whole model, float32: greedy tokens equal transformers' and log-probabilities within 1e-4 (every architecture
  with transformers' own forward, gpt-oss included), and within 1e-5 of the loop for the stored formats.
The three-tier bit-exactness of whole models is tests/experts/test_three_tiers_batched.py.
"""

from __future__ import annotations

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.bench.checkpoints import ARCHS
from moeserve.models import model as model_module
from moeserve.models.experts.kernels import (
    ENTRY_ROWS,
    GROUP,
    BatchedExperts,
    RoutedTokens,
    TorchExperts,
    add_in_expert_order,
    choose_expert_kernel,
)
from moeserve.models.experts.unit_math import SwiGLUMath
from moeserve.models.numerics import Numerics
from tests.engine.test_parity_transformers import PROMPTS, hf_greedy, hf_model
from tests.experts.test_three_tiers import FORMATS, folder_of

H, INTER, E, K = 64, 32, 24, 4


def routing(n: int, seed: int, dtype: torch.dtype) -> RoutedTokens:
    """n tokens, each to K distinct experts of E (expert 0 chosen by many tokens: more than ENTRY_ROWS)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)])
    ids[: n // 2, 0] = torch.where((ids[: n // 2] == 0).any(1), ids[: n // 2, 0], 0)
    ids = torch.stack([row if len(set(row.tolist())) == K else torch.randperm(E, generator=g)[:K] for row in ids])
    weights = torch.rand(n, K, generator=g)
    flat = ids.flatten()
    order = torch.sort(flat * n + torch.arange(n).repeat_interleave(K), stable=True).indices  # by expert, token
    token_of = torch.arange(n).repeat_interleave(K)[order]
    counts = torch.bincount(flat, minlength=E).tolist()
    x = torch.randn(n, H, generator=g).to(dtype)
    return RoutedTokens.from_counts(x, ids, token_of, weights.flatten()[order], counts)


def units(dtype: torch.dtype, seed: int = 1) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {e: ((torch.randn(2 * INTER, H, generator=g) * 0.2).to(dtype), (torch.randn(H, INTER, generator=g) * 0.2).to(dtype))
            for e in range(E)}


def run(kernel, routed: RoutedTokens, w: dict, chunk: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    out = torch.zeros_like(routed.x)
    experts = routed.experts
    chunks = [[(e, w[e]) for e in experts[i : i + chunk]] for i in range(0, len(experts), chunk)]
    kernel.run(out, routed, chunks)
    return out


@pytest.mark.parametrize("group", [GROUP, K, 1])
@pytest.mark.parametrize("invariant", [False, True])
def test_batched_equals_the_loop_in_float32_and_its_bits_never_depend_on_the_chunking(invariant: bool,
                                                                                      group: int) -> None:
    numerics = Numerics(batch_invariant=invariant)
    batched = BatchedExperts(SwiGLUMath(), numerics, "test", group)
    for n in (1, 3, 40):  # decode-sized, and a prefill whose expert 0 has more than ENTRY_ROWS tokens
        routed = routing(n, seed=n, dtype=torch.float32)
        assert n < 40 or max(hi - lo for lo, hi in routed.spans.values()) > ENTRY_ROWS
        w = units(torch.float32)
        loop = run(TorchExperts(SwiGLUMath(), numerics), routed, w, E)
        torch.testing.assert_close(run(batched, routed, w, E), loop, rtol=1e-5, atol=1e-5)
        routed16, w16 = routing(n, seed=n, dtype=torch.bfloat16), units(torch.bfloat16)
        resident = run(batched, routed16, w16, E)  # one chunk: all experts
        for chunk in (1, 3, GROUP, GROUP + 1):  # offloaded: chunks as a cache of `chunk` slots yields them
            assert torch.equal(run(batched, routed16, w16, chunk), resident), f"n={n}, chunks of {chunk}"


def test_batch_invariant_mode_gives_a_token_the_same_bits_whatever_the_other_tokens() -> None:
    batched, w = BatchedExperts(SwiGLUMath(), Numerics(batch_invariant=True), "test"), units(torch.bfloat16)
    full = routing(40, seed=7, dtype=torch.bfloat16)
    out = run(batched, full, w, E)
    for t in (0, 17, 39):  # the same token alone, with its own routing
        pairs = (full.token_of == t).nonzero().squeeze(1)
        experts = [e for e, (lo, hi) in full.spans.items() if any(lo <= int(p) < hi for p in pairs)]
        alone = RoutedTokens.from_counts(full.x[t : t + 1], full.ids[t : t + 1], torch.zeros(len(experts),
                                         dtype=torch.long), full.weight_of[pairs],
                                         [1 if e in experts else 0 for e in range(E)])
        assert torch.equal(run(batched, alone, w, E)[0], out[t])


def test_the_ordered_add_is_the_loops_adds_bit_for_bit() -> None:
    routed = routing(40, seed=3, dtype=torch.bfloat16)
    y = torch.randn(len(routed.token_of), H).to(torch.bfloat16) * 100
    expected = torch.randn(40, H).to(torch.bfloat16)
    out = expected.clone()
    for lo, hi in routed.spans.values():  # the loop: expert by expert, ascending
        expected[routed.token_of[lo:hi]] += y[lo:hi]
    add_in_expert_order(out, routed.token_of, y)
    assert torch.equal(out, expected)


def test_the_device_chooses_the_batched_kernel_and_the_log_says_why() -> None:
    math = SwiGLUMath()
    cuda = choose_expert_kernel(math, Numerics(), torch.bfloat16, torch.device("cuda"))
    assert isinstance(cuda, BatchedExperts) and cuda.describe().startswith("batched (on cuda: SwiGLUMath stacked")
    assert cuda.group == GROUP and "in calls of 8 x 16 rows" in cuda.describe()
    top2 = choose_expert_kernel(math, Numerics(), torch.bfloat16, torch.device("cuda"), top_k=2)
    assert isinstance(top2, BatchedExperts) and top2.group == 2  # one token's experts: one call, no padding
    assert isinstance(choose_expert_kernel(math, Numerics(), torch.bfloat16), TorchExperts)  # CPU, no C++
    asked = choose_expert_kernel(math, Numerics(cpp=True), torch.bfloat16, batched=True)
    assert isinstance(asked, BatchedExperts) and "asked for" in asked.describe()


def _always_batched(*args, **kwargs):  # type: ignore[no-untyped-def]
    return choose_expert_kernel(*args, **{**kwargs, "batched": True})


@pytest.fixture
def batched(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_module, "choose_expert_kernel", _always_batched)


STEPS = 8


def greedy(folder, kernel: str = "batched", **settings):  # type: ignore[no-untyped-def]
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", threads=1, **settings)
    assert llm.engine.model.moe_blocks[0].experts.name == kernel
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=5)
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]


@pytest.mark.slow
@pytest.mark.parametrize("arch", [*ARCHS, "gpt_oss"])
def test_batched_kernel_matches_transformers_in_float32(tiny_checkpoint, batched, arch: str) -> None:
    if arch == "gpt_oss":
        from tests.fixtures import checkpoints as C

        folder = C.write_gpt_oss(tiny_checkpoint("qwen3_moe").parent / "gpt_oss_f32", dtype="float32")
    else:
        folder = tiny_checkpoint(arch)
    ref_model = hf_model(folder, torch.float32)
    for prompt, ours in zip(PROMPTS, greedy(folder)):
        ref_tokens, ref_logps = hf_greedy(ref_model, prompt, STEPS)
        assert ours.token_ids == ref_tokens, f"{arch} prompt len {len(prompt)}"
        for step, (lp, ref) in enumerate(zip(ours.logprobs, ref_logps)):
            for token_id, entry in lp.items():
                assert abs(entry.logprob - float(ref[token_id])) < 1e-4, (arch, step, token_id)


@pytest.mark.parametrize("fmt", FORMATS)
def test_batched_kernel_is_the_loop_within_float32_rounding_for_every_format(folder_of, monkeypatch, fmt: str) -> None:
    """The stored formats' stacked dequantization (and int8's one batched op) against the per-expert loop."""
    settings = {"quantization": "int8"} if fmt.startswith("int8") else {}
    folder = folder_of(fmt)
    loop = greedy(folder, "torch", kernels="torch", **settings)
    monkeypatch.setattr(model_module, "choose_expert_kernel", _always_batched)
    ours = greedy(folder, "batched", kernels="torch", **settings)
    for a, b in zip(ours, loop):
        assert a.token_ids == b.token_ids, fmt
        for lp, ref in zip(a.logprobs, b.logprobs):
            assert lp.keys() == ref.keys()
            assert all(abs(lp[t].logprob - ref[t].logprob) < 1e-5 for t in lp), fmt


__all__ = ["folder_of"]  # a fixture, used by name
