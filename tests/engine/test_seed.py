"""`seed` seeds sampling: the engine's seed for requests without one, a request's own seed for itself alone."""

from __future__ import annotations

import pytest

from moeserve import LLM, SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time"]


@pytest.fixture(scope="module")
def engines():
    made: dict[int, LLM] = {}

    def get(seed: int) -> LLM:
        if seed not in made:
            made[seed] = LLM(seed=seed)  # the bundled demo model
        return made[seed]

    yield get
    for llm in made.values():
        llm.engine.close()


def texts(llm: LLM, params: SamplingParams, prompts=PROMPTS) -> list[str]:  # noqa: ANN001
    return [o.outputs[0].text for o in llm.generate(prompts, params)]


def test_same_engine_seed_same_text_and_another_seed_differs(engines) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    a, b = texts(engines(7), params), texts(LLM(seed=7), params)
    assert a == b  # two engines, same seed, same requests in the same order
    assert texts(engines(8), params) != a


def test_engine_seed_is_not_torch_global_state(engines) -> None:
    """Unseeded requests draw from the engine's generator: torch's global RNG does not move them."""
    import torch

    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    fresh = LLM(seed=11)
    first = texts(fresh, params)
    again = LLM(seed=11)
    torch.manual_seed(12345)
    torch.rand(100)
    assert texts(again, params) == first


def test_a_seeded_request_is_the_same_alone_and_in_a_batch(engines) -> None:
    llm = engines(7)
    seeded = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=42)
    alone = llm.generate([PROMPTS[0]], seeded)[0].outputs[0].text
    other = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    batch = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[1]], [other, seeded, other])
    assert batch[1].outputs[0].text == alone
    assert llm.generate([PROMPTS[0]], SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True,
                                                     seed=43))[0].outputs[0].text != alone
