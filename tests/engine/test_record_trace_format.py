"""record_trace_format=jsonl: the engine writes the JSON-lines trace directly, with the same content as its binary
trace of the same run (layers, every token's experts in router order, prefetch guesses)."""

from __future__ import annotations

import json

from moeserve.engine.llm import LLM
from moeserve.engine.sampling_params import SamplingParams
from moeserve.experts.traces.jsonl import read_jsonl_trace
from moeserve.experts.traces.moetrace import read_trace

PROMPTS = [{"prompt_token_ids": [3, 17, 42, 9, 250]}, {"prompt_token_ids": [11, 5, 77]}]
PARAMS = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


def record(folder, path, fmt: str) -> list[list[int]]:
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", threads=1, record_trace=str(path),
              record_trace_format=fmt, expert_cache_gb=8e-5, prefetch=True)  # offloaded: guesses are recorded
    try:
        outs = llm.generate(PROMPTS, PARAMS)
    finally:
        llm.engine.close()
    return [o.outputs[0].token_ids for o in outs]


def test_engine_writes_jsonl_with_the_binary_traces_content(tiny_checkpoint, tmp_path):
    folder = tiny_checkpoint("qwen3_moe")
    tokens_bin = record(folder, tmp_path / "run.moetrace", "moetrace")
    tokens_jsonl = record(folder, tmp_path / "run.jsonl", "jsonl")
    assert tokens_bin == tokens_jsonl
    binary, jsonl = read_trace(tmp_path / "run.moetrace"), read_jsonl_trace(tmp_path / "run.jsonl")
    assert jsonl.inferred == [] and jsonl.header == binary.header  # the engine writes every header field
    steps = binary.steps()
    assert len(steps) == len(jsonl.steps) > 1
    assert any(r.predicted is not None for step in steps for r in step)  # the comparison covers guesses too
    for a, b in zip(steps, jsonl.steps):
        assert [(r.layer, r.topk_ids.tolist(), r.predicted_layer) for r in a] == [
            (r.layer, r.topk_ids.tolist(), r.predicted_layer) for r in b]
        assert [None if r.predicted is None else r.predicted.tolist() for r in a] == [
            None if r.predicted is None else r.predicted.tolist() for r in b]
    first = json.loads((tmp_path / "run.jsonl").read_text().splitlines()[1])
    assert first["step"] == 0 and len(first["experts"]) == 8  # the prefill step: 5 + 3 prompt tokens
