"""Constrained decoding in the engine (engine/grammar.py through the sampler): outputs follow the grammar, greedy and
sampled, n > 1; requests without a constraint get exactly their solo tokens when batched with constrained ones;
the mask allows the sequence's end tokens exactly when the grammar is satisfied. Prints the mask cost per token."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from moeserve.engine.grammar import GrammarCompiler, GrammarSpec
from moeserve.engine.llm import LLM
from moeserve.engine.sampling_params import SamplingParams
from moeserve.errors import RequestError

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "ok": {"type": "boolean"}}, "required": ["name", "age", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(tiny_text_model: Path) -> LLM:
    return LLM(str(tiny_text_model), dtype="float32", threads=1)


def _compile(llm: LLM, kind: str, value: object):  # noqa: ANN202 - GrammarConstraint
    compiler = llm.engine.grammar_compiler
    assert compiler is not None
    return compiler.compile(GrammarSpec(kind, value, "test"))  # type: ignore[arg-type]


def test_outputs_follow_the_schema_greedy_and_sampled(llm: LLM) -> None:
    constraint = _compile(llm, "json_schema", SCHEMA)
    params = [SamplingParams(temperature=0, max_tokens=120, constraint=constraint)]
    params += [SamplingParams(temperature=1.0, max_tokens=120, seed=s, n=2, constraint=constraint) for s in range(4)]
    for p in params:
        for comp in llm.generate(["Tell me about a person"], p)[0].outputs:
            assert comp.finish_reason == "stop", comp.text  # ended by the grammar, not max_tokens
            jsonschema.validate(json.loads(comp.text), SCHEMA)


def test_regex_and_choice(llm: LLM) -> None:
    regex = _compile(llm, "regex", r"[0-9]{3}-[a-z]{2,4}")
    choice = _compile(llm, "choice", ["yes", "no", "maybe so"])
    for seed in range(5):
        text = llm.generate(["x"], SamplingParams(temperature=1.0, seed=seed, max_tokens=30, constraint=regex))
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text[0].outputs[0].text)
        text = llm.generate(["x"], SamplingParams(temperature=1.0, seed=seed, max_tokens=30, constraint=choice))
        assert text[0].outputs[0].text in ("yes", "no", "maybe so")


def test_invalid_grammars_are_request_errors(llm: LLM) -> None:
    for kind, value in [("json_schema", {"type": "foo"}), ("regex", "(ab"), ("lark", "start: undefined_rule"),
                        ("json_schema", [1])]:
        with pytest.raises(RequestError) as info:
            _compile(llm, kind, value)
        assert "\n" not in str(info.value)


def test_unconstrained_requests_get_their_solo_tokens_beside_constrained_ones(llm: LLM) -> None:
    engine = llm.engine
    constraint = _compile(llm, "json_schema", SCHEMA)
    plain = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)]
    prompts = ["The cat sat", "A dog ran far away", "Hello"]
    solo = [llm.generate([p], sp)[0].outputs[0] for p, sp in zip(prompts, plain)]
    for i, (p, sp) in enumerate(zip(prompts, plain)):
        engine.add_request(p, sp, request_id=f"plain{i}")
        engine.add_request("Tell me", SamplingParams(temperature=1.0, seed=i, max_tokens=60, constraint=constraint),
                           request_id=f"json{i}")
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    for i, alone in enumerate(solo):
        assert done[f"plain{i}"].token_ids == alone.token_ids
        assert done[f"plain{i}"].logprobs == alone.logprobs
        assert done[f"json{i}"].finish_reason == "stop"
        jsonschema.validate(json.loads(done[f"json{i}"].text), SCHEMA)


def test_end_tokens_are_allowed_exactly_when_the_grammar_is_satisfied(tiny_text_model: Path) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_text_model / "tokenizer.json"))
    vocab, eos, stop = tok.get_vocab_size() + 20, tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    compiler = GrammarCompiler(tok.to_str(), vocab, [eos])
    processor = compiler.compile(GrammarSpec("regex", "ab(c)?", "test")).new_processor({eos, stop})
    assert processor.allowed().shape == (vocab,)
    for text, end_ok in (("a", False), ("b", False), ("c", True)):  # before each token
        allowed = processor.allowed()
        assert bool(allowed[eos]) == end_ok and bool(allowed[stop]) == end_ok
        token = tok.token_to_id(text)
        assert allowed[token]
        assert not allowed[tok.get_vocab_size():].any()  # padding rows of the embedding are never allowed
        processor.accept(token)
    assert processor.is_finished()  # "abc": nothing may follow
    logits = torch.zeros(vocab)
    processor.mask(logits)
    assert torch.isfinite(logits).sum() == 2  # only the two end tokens


def test_mask_cost_per_token_is_printed(llm: LLM) -> None:
    """Not a timing assertion: the cost is printed (pytest -s) for the record; scripts/bench_structured.py measures it
    with a real vocabulary."""
    constraint = _compile(llm, "json_schema", SCHEMA)
    processor = constraint.new_processor(set(llm.engine.eos_token_ids))
    seconds, tokens = 0.0, 0
    for seed in range(3):
        seq_params = SamplingParams(temperature=1.0, seed=seed, max_tokens=120, constraint=constraint)
        out = llm.generate(["x"], seq_params)[0].outputs[0]
        processor = constraint.new_processor(set(llm.engine.eos_token_ids))
        for token in out.token_ids:
            logits = torch.zeros(processor.vocab_size)  # type: ignore[attr-defined]
            processor.mask(logits)
            processor.accept(token)
        seconds += processor.mask_seconds  # type: ignore[attr-defined]
        tokens += processor.masks  # type: ignore[attr-defined]
    print(f"\nmask cost: {seconds / tokens * 1e6:.1f} us per token over {tokens} tokens "
          f"(vocabulary {processor.vocab_size})")  # type: ignore[attr-defined]
    assert tokens > 0
