"""Sampling parameters, stop rules, EOS handling and logprobs, with vLLM's semantics."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.engine.sampler import apply_penalties, filter_logits
from moeserve.errors import RequestError

PROMPT = {"prompt_token_ids": [11, 42, 7, 99, 3]}


@pytest.fixture(scope="module")
def llm(tiny_text_model) -> LLM:
    return LLM(str(tiny_text_model), dtype="float32")


def test_seed_reproducible_and_seeds_differ(llm: LLM) -> None:
    def sample(seed: int) -> list[int]:
        p = SamplingParams(temperature=1.0, max_tokens=12, seed=seed, ignore_eos=True)
        return llm.generate(PROMPT, p)[0].outputs[0].token_ids

    assert sample(7) == sample(7)
    assert len({tuple(sample(s)) for s in range(5)}) > 1


def test_seeded_sample_does_not_depend_on_batch_neighbours(llm: LLM) -> None:
    p = SamplingParams(temperature=1.0, max_tokens=8, seed=3, ignore_eos=True)
    alone = llm.generate(PROMPT, p)[0].outputs[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=8, seed=99, ignore_eos=True)
    together = llm.generate([{"prompt_token_ids": [5, 6]}, PROMPT], [other, p])[1].outputs[0].token_ids
    assert together == alone


def test_top_k_one_is_greedy(llm: LLM) -> None:
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    top1 = llm.generate(PROMPT, SamplingParams(temperature=0.8, top_k=1, max_tokens=10, ignore_eos=True, seed=1))
    assert greedy[0].outputs[0].token_ids == top1[0].outputs[0].token_ids


def test_max_tokens_and_length_reason(llm: LLM) -> None:
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


def test_stop_token_ids(llm: LLM) -> None:
    base = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].outputs[0]
    stop_id = base.token_ids[3]
    first = base.token_ids.index(stop_id)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                              stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == base.token_ids[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)


def test_stop_string_cuts_text(llm: LLM) -> None:
    prompt = "Once upon a time"
    base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    assert len(base.text) > 6
    stop = base.text[3:6]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=stop))[0]
    at = base.text.find(stop)
    assert out.outputs[0].text == base.text[:at]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", stop)
    kept = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=stop,
                                               include_stop_str_in_output=True))[0]
    assert kept.outputs[0].text == base.text[: at + len(stop)]


def test_eos_from_generation_config_and_ignore_eos(tiny_text_model, tmp_path) -> None:
    folder = tmp_path / "m"
    shutil.copytree(tiny_text_model, folder)
    llm = LLM(str(folder), dtype="float32")
    base = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    eos = base.token_ids[2]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 10**6]}))
    llm = LLM(str(folder), dtype="float32")
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == eos
    assert len(out.token_ids) == base.token_ids.index(eos) + 1
    assert len(llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
               .outputs[0].token_ids) == 8


def test_logprobs_topk_semantics(llm: LLM) -> None:
    out = llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=5, max_tokens=6, logprobs=3,
                                              ignore_eos=True))[0].outputs[0]
    assert len(out.logprobs) == 6
    total = 0.0
    for token, lp in zip(out.token_ids, out.logprobs):
        assert token in lp and 3 <= len(lp) <= 4
        ranked = sorted(lp.values(), key=lambda v: v.rank)
        assert [v.rank for v in ranked][:3] == [1, 2, 3]
        assert all(a.logprob >= b.logprob for a, b in zip(ranked, ranked[1:]))
        assert sum(math.exp(v.logprob) for v in lp.values()) <= 1.0 + 1e-5
        total += lp[token].logprob
        assert all(v.decoded_token is not None for v in lp.values())
    assert out.cumulative_logprob == pytest.approx(total)


def test_n_samples(llm: LLM) -> None:
    out = llm.generate(PROMPT, SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=5, ignore_eos=True))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 5 for o in out.outputs)


def test_prompt_too_long_uses_openai_wording(tiny_text_model) -> None:
    llm = LLM(str(tiny_text_model), dtype="float32", max_model_len=16)
    with pytest.raises(RequestError, match="This model's maximum context length is 16 tokens"):
        llm.generate({"prompt_token_ids": list(range(16))})
    out = llm.generate({"prompt_token_ids": list(range(10))}, SamplingParams(max_tokens=50, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6 and out[0].outputs[0].finish_reason == "length"


def test_invalid_sampling_params() -> None:
    with pytest.raises(RequestError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(RequestError, match="temperature"):
        SamplingParams(temperature=-1)


def test_repetition_penalty_rule() -> None:
    from moeserve.engine.sequence import Sequence

    seq = Sequence("r", 0, [1, 2], SamplingParams(repetition_penalty=2.0), 100, set())
    logits = torch.tensor([1.0, 4.0, -4.0, 3.0])
    assert apply_penalties(logits.clone(), seq).tolist() == [1.0, 2.0, -8.0, 3.0]


def test_greedy_batch_fast_path_matches_per_row_rules() -> None:
    """A batch of plain greedy rows takes one argmax; a penalised or logprobs row sends the batch row by row."""
    from moeserve.engine.sampler import Sampler
    from moeserve.engine.sequence import Sequence

    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, -1.0, 2.0, 4.9]])  # row 0: a tie, the first index wins
    plain = [Sequence("r", i, [1], SamplingParams(temperature=0), 100, set()) for i in range(2)]
    assert Sampler()(logits, plain) == [(1, None), (0, None)]
    penalised = Sequence("p", 0, [0], SamplingParams(temperature=0, repetition_penalty=2.0), 100, set())
    assert [t for t, _ in Sampler()(logits, [plain[0], penalised])] == [1, 3]  # 5.0 / 2 < 4.9
    with_logprobs = Sequence("l", 0, [1], SamplingParams(temperature=0, logprobs=1), 100, set())
    (token, logprobs), = Sampler()(logits[1:], [with_logprobs])
    assert token == 0 and logprobs is not None and set(logprobs) == {0}


def test_filters_by_hand() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = lambda t: (t > float("-inf")).tolist()  # noqa: E731
    assert kept(filter_logits(logits, top_k=2, top_p=1.0, min_p=0.0)) == [True, True, False, False]
    assert kept(filter_logits(logits, top_k=0, top_p=0.7, min_p=0.0)) == [True, True, False, False]
    assert kept(filter_logits(logits, top_k=0, top_p=1.0, min_p=0.2)) == [True, True, True, False]


def test_chat_uses_template(llm: LLM) -> None:
    msgs = [{"role": "user", "content": "Hello"}]
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert out.prompt == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"


def test_extreme_parameters_do_not_break_the_engine(llm: LLM) -> None:
    """A temperature of 1e-300 is greedy (vLLM's rule), not a division overflow that kills every request."""
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    tiny = llm.generate(PROMPT, SamplingParams(temperature=1e-300, max_tokens=6, ignore_eos=True))
    assert tiny[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids
    hot = llm.generate(PROMPT, SamplingParams(temperature=1e-4, repetition_penalty=100, max_tokens=6,
                                              ignore_eos=True, seed=0))
    assert len(hot[0].outputs[0].token_ids) == 6
    with pytest.raises(RequestError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=1e-300)


def test_batched_greedy_picks_what_torch_argmax_picks() -> None:
    """The plain-greedy fast path (numpy's argmax) against torch.argmax: ties (first wins), NaN, -inf rows."""
    from types import SimpleNamespace

    from moeserve.engine.sampler import Sampler

    gen = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 4, (6, 500), generator=gen).float()  # many ties at the maximum
    logits[1, 7] = float("nan")
    logits[2] = float("-inf")
    logits[3, 499] = 1e30
    params = SamplingParams(temperature=0)
    seqs = [SimpleNamespace(params=params, logits_processor=None) for _ in range(logits.shape[0])]
    got = [token for token, _ in Sampler()(logits, seqs)]  # type: ignore[arg-type]
    assert got == torch.argmax(logits, dim=-1).tolist()
