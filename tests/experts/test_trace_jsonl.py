"""The JSON-lines trace format: writer and reader agree, binary <-> JSON lines is lossless, missing header fields
are inferred (and said), and every malformed line is a one-line error naming its line."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from moeserve.experts.calls import static_policy_options
from moeserve.experts.traces.jsonl import (
    JsonlTraceWriter,
    file_format,
    read_jsonl_trace,
    read_trace_file,
    write_trace_file,
)
from moeserve.experts.traces.moetrace import TraceError, TraceHeader, TraceWriter, read_trace

HEADER = TraceHeader(model="toy", num_layers=5, num_experts=16, top_k=3, moe_layers=(1, 2, 4))


def random_steps(writer, steps: int, seed: int = 0) -> list[list[tuple[int, list[list[int]]]]]:
    """Write ``steps`` random steps (1-4 tokens, some predictions) with ``writer``; returns what was written."""
    rng = random.Random(seed)
    written = []
    for _ in range(steps):
        step = []
        tokens = rng.randint(1, 4)
        for layer in HEADER.moe_layers:
            ids = [rng.sample(range(HEADER.num_experts), HEADER.top_k) for _ in range(tokens)]
            guess = [rng.randrange(HEADER.num_experts) for _ in range(2)] if rng.random() < 0.5 else None
            writer.record(layer, np.array(ids, dtype=np.int64), predicted_next=guess)
            step.append((layer, ids, guess))
        writer.end_step()
        written.append(step)
    return written


def as_lists(steps) -> list[list[tuple]]:
    """Steps -> plain lists (layer, ids, predicted layer, predicted ids) for comparison."""
    return [
        [(r.layer, r.topk_ids.tolist(), r.predicted_layer, None if r.predicted is None else r.predicted.tolist())
         for r in step]
        for step in steps
    ]


def test_writer_and_reader_agree(tmp_path):
    path = tmp_path / "t.jsonl"
    with JsonlTraceWriter(path, HEADER) as w:
        written = random_steps(w, 30)
    lines = path.read_text().splitlines()
    assert json.loads(lines[0]) == {"model": "toy", "num_layers": 5, "num_experts": 16, "top_k": 3,
                                    "moe_layers": [1, 2, 4]}
    assert json.loads(lines[1])["step"] == 0 and json.loads(lines[-1])["step"] == 29
    trace = read_jsonl_trace(path)
    assert trace.header == HEADER and trace.inferred == []
    got = trace.steps
    assert len(got) == 30
    for step, want in zip(got, written):
        assert [r.layer for r in step] == [layer for layer, _, _ in want]
        assert [r.topk_ids.tolist() for r in step] == [ids for _, ids, _ in want]
        for rec, (_, _, guess) in zip(step, want):
            if guess is None:
                assert rec.predicted is None
            else:
                assert rec.predicted.tolist() == [guess]
                assert rec.predicted_layer == HEADER.next_moe_layer(rec.layer)


def test_binary_to_jsonl_and_back_is_lossless(tmp_path):
    binary = tmp_path / "t.moetrace"
    with TraceWriter(binary, HEADER) as w:
        random_steps(w, 25, seed=3)
    assert file_format(binary) == "moetrace"
    write_trace_file(tmp_path / "t.jsonl", read_trace(binary).header, read_trace(binary), "jsonl")
    assert file_format(tmp_path / "t.jsonl") == "jsonl"
    back = tmp_path / "back.moetrace"
    write_trace_file(back, HEADER, read_jsonl_trace(tmp_path / "t.jsonl").steps, "moetrace")
    assert as_lists(read_jsonl_trace(tmp_path / "t.jsonl").steps) == as_lists(read_trace(binary))
    assert back.read_bytes() == binary.read_bytes()  # same header, same records: the same bytes


def test_missing_header_is_inferred_and_said(tmp_path):
    path = tmp_path / "bare.jsonl"
    rows = [
        {"step": 0, "layer": 3, "experts": [[1, 7], [2, 1]]},
        {"step": 0, "layer": 5, "experts": [[0, 9]]},
        {"step": 4, "layer": 3, "experts": []},  # an empty batch; steps may skip numbers
        {"step": 4, "layer": 5, "experts": [[4, 5]]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")  # a trailing blank line is fine
    trace = read_jsonl_trace(path)
    h = trace.header
    assert (h.model, h.num_experts, h.top_k, h.moe_layers, h.num_layers) == ("bare", 10, 2, (3, 5), 6)
    assert len(trace.inferred) == 4
    assert any(note.startswith("num_experts=10") for note in trace.inferred)
    assert [len(s) for s in trace.steps] == [2, 2]
    assert trace.steps[1][0].topk_ids.shape == (0, 2)
    # A partial header: the given fields are kept (and checked), the rest inferred.
    path.write_text(json.dumps({"num_experts": 64, "top_k": 2}) + "\n" + json.dumps(rows[0]) + "\n")
    trace = read_jsonl_trace(path)
    assert trace.header.num_experts == 64 and trace.header.moe_layers == (3,)
    assert [n.split("=")[0] for n in trace.inferred] == ["moe_layers", "num_layers"]


def test_static_policy_reads_a_jsonl_trace(tmp_path):
    with TraceWriter(tmp_path / "t.moetrace", HEADER) as w:
        random_steps(w, 10, seed=5)
    write_trace_file(tmp_path / "t.jsonl", HEADER, read_trace(tmp_path / "t.moetrace"), "jsonl")
    assert static_policy_options(str(tmp_path / "t.jsonl"), 8) == static_policy_options(
        str(tmp_path / "t.moetrace"), 8)


HEAD = json.dumps({"num_layers": 4, "num_experts": 8, "top_k": 2, "moe_layers": [1, 3]})
GOOD = '{"step": 0, "layer": 1, "experts": [[0, 1]]}'


@pytest.mark.parametrize(
    ("lines", "line", "words"),
    [
        ([HEAD, GOOD, '{"step": 0, "layer": 3, "experts": [[0, 1]]'], 3, "not valid JSON"),
        ([HEAD, "[1, 2]"], 2, "expected a JSON object"),
        ([HEAD, GOOD, '{"step": 1, "layer": 1, "experts": [[0, 1]]}', '{"step": 0, "layer": 3, "experts": [[2, 3]]}'],
         4, "steps must not decrease"),
        ([HEAD, '{"step": 0, "layer": 1, "experts": [[0, 8]]}'], 2, "expert id 8 out of range 0..7"),
        ([HEAD, '{"step": 0, "layer": 1, "experts": [[0, -1]]}'], 2, "out of range"),
        ([HEAD, '{"step": 0, "layer": 1, "experts": [[0, 1, 2]]}'], 2, "3 experts per token, but top_k is 2 (in the header)"),
        ([GOOD, '{"step": 0, "layer": 3, "experts": [[4]]}'], 2, "1 experts per token, but top_k is 2 (from line 1)"),
        ([HEAD, '{"step": 0, "layer": 2, "experts": [[0, 1]]}'], 2, "layer 2 is not in the header's moe_layers"),
        ([HEAD, GOOD, GOOD], 3, "layer 1 twice in step 0"),
        ([HEAD, '{"step": 0, "layer": 1, "expert": [[0, 1]]}'], 2, "did you mean 'experts'"),
        ([HEAD, '{"step": 0, "layer": 1, "experts": [[0, 0]]}'], 2, "the same expert twice"),
        ([HEAD, '{"step": 0, "layer": 1, "experts": [[0, 1], [2]]}'], 2, "different numbers of experts"),
        ([HEAD, '{"step": 0, "layer": 1, "experts": [[0, 1.5]]}'], 2, "must be integers"),
        ([HEAD, '{"step": "0", "layer": 1, "experts": [[0, 1]]}'], 2, "step and layer must be integers"),
        ([HEAD, '{"layer": 1, "experts": [[0, 1]]}'], 2, "only the first line may be a header"),
        ([HEAD, '{"step": 0, "layer": 1, "experts": [[0, 1]], "predicted": [[9]]}'], 2, "expert id 9 out of range"),
        ([json.dumps({"num_experts": 8, "topk": 2}), GOOD], 1, "did you mean 'top_k'"),
        ([json.dumps({"num_experts": 0}), GOOD], 1, "num_experts=0 must be an integer >= 1"),
        ([json.dumps({"moe_layers": [1, 1]}), GOOD], 1, "must be non-empty and unique"),
        ([json.dumps({"num_experts": 8})], None, "no layer calls to infer"),
    ],
)
def test_bad_lines_are_one_line_errors_naming_the_line(tmp_path, lines, line, words):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError) as err:
        read_jsonl_trace(path)
    message = str(err.value)
    assert "\n" not in message and words in message
    if line is not None:
        assert message.startswith(f"{path}:{line}: ")


def test_a_cut_short_last_line_says_so(tmp_path):
    path = tmp_path / "cut.jsonl"
    path.write_text(HEAD + "\n" + GOOD + "\n" + GOOD[:20])
    with pytest.raises(TraceError, match=r"cut.jsonl:3: .*ends inside this line"):
        read_jsonl_trace(path)


def test_file_format_refuses_what_is_neither(tmp_path):
    (tmp_path / "junk").write_bytes(b"hello, not a trace")
    with pytest.raises(TraceError, match="not a routing trace"):
        read_trace_file(tmp_path / "junk")
    with pytest.raises(TraceError, match="no such trace file"):
        file_format(tmp_path / "missing")
