"""Incremental detokenization (Sequence keeps decoding only its last few tokens) gives the text a full decode gives,
never shows a partial UTF-8 character while running, and finds stop strings that span steps."""

from __future__ import annotations

import random

import pytest

from moeserve.bench.checkpoints import write_tiny_tokenizer
from moeserve.engine.llm_engine import demo_model_path
from moeserve.engine.sampling_params import SamplingParams
from moeserve.engine.sequence import Sequence, Status
from moeserve.tokenizer import Tokenizer


@pytest.fixture(scope="module", params=["tiny_byte_level", "demo"])
def tokenizer(request, tmp_path_factory) -> Tokenizer:
    if request.param == "demo":
        return Tokenizer(demo_model_path())
    return Tokenizer(write_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


def feed(tok: Tokenizer, ids: list[int], params: SamplingParams) -> tuple[Sequence, list[str]]:
    seq = Sequence("r", 0, [1], params, max_model_len=10_000, eos_token_ids=set())
    shown = []
    for t in ids:
        seq.append(t, None, lambda x: tok.decode(x, skip_special_tokens=params.skip_special_tokens))
        shown.append(seq.visible_text())
        if seq.status == Status.FINISHED:
            break
    return seq, shown


@pytest.mark.parametrize("seed", range(8))
def test_text_equals_a_full_decode(tokenizer, seed):
    vocab = tokenizer._tok.get_vocab_size()
    rng = random.Random(seed)
    ids = [rng.randrange(vocab) for _ in range(300)]  # byte tokens included: characters split across tokens
    params = SamplingParams(max_tokens=len(ids), ignore_eos=True)
    seq, shown = feed(tokenizer, ids, params)
    full = tokenizer.decode(ids)
    assert seq.status == Status.FINISHED and seq.text == full
    for n, text in enumerate(shown[:-1], start=1):  # while running: a prefix of the final text, no U+FFFD tail
        assert full.startswith(text) and not text.endswith("\ufffd"), n


def test_stop_string_across_steps(tokenizer):
    text = "Hello, how are you? I am fine, thank you."
    ids = tokenizer.encode(text, add_special_tokens=False)
    params = SamplingParams(max_tokens=len(ids), ignore_eos=True, stop=["are you? I"])
    seq, _ = feed(tokenizer, ids, params)
    assert seq.status == Status.FINISHED and seq.finish_reason == "stop" and seq.stop_reason == "are you? I"
    assert seq.text == "Hello, how "
