"""Routing-trace file format: round trip, appending, and errors on corrupt files."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from moeserve.experts.traces.moetrace import TraceError, TraceHeader, TraceWriter, read_trace


def header(**kw) -> TraceHeader:
    base = dict(model="tiny", num_layers=4, num_experts=300, top_k=2, moe_layers=(1, 3))
    return TraceHeader(**{**base, **kw})


def test_round_trip(tmp_path):
    path = tmp_path / "t.moetrace"
    step0_l1 = np.array([[299, 0], [5, 7], [5, 1]], dtype=np.int64)  # what the engine passes: int64 [T, k]
    with TraceWriter(path, header()) as w:
        w.record(1, step0_l1, predicted_next=[2, 4])
        w.record(3, [[1, 2]])
        w.end_step()
        w.record(1, np.zeros((0, 2), dtype=np.int64))  # an empty batch is legal
        w.record(3, [[8, 9]], predicted_next=np.array([[0, 1]]))  # last layer predicts the next step's first
        w.end_step()
    trace = read_trace(path)
    assert trace.header == header()
    steps = trace.steps()
    assert len(steps) == 2
    first = steps[0]
    assert [r.layer for r in first] == [1, 3]
    assert first[0].topk_ids.dtype == np.uint16
    np.testing.assert_array_equal(first[0].topk_ids, step0_l1)
    assert first[0].unique_experts() == [0, 1, 5, 7, 299]
    assert first[0].predicted_layer == 3 and first[0].predicted.tolist() == [[2, 4]]
    assert first[1].predicted is None
    assert steps[1][0].topk_ids.shape == (0, 2)
    assert steps[1][1].predicted_layer == 1
    # Layout: 8 magic + 2 version + 4 header length + header, then per record 1 + 8 + 2*T*k bytes.
    blob = path.read_bytes()
    assert blob[:8] == b"MOETRACE"
    version, header_len = struct.unpack("<HI", blob[8:14])
    assert version == 1
    records = (1 + 8 + 12) + (1 + 8 + 4) + (1 + 8 + 4) + 1 + (1 + 8) + (1 + 8 + 4) + (1 + 8 + 4) + 1
    assert len(blob) == 14 + header_len + records


def test_append_and_truncated_tail(tmp_path):
    path = tmp_path / "t.moetrace"
    with TraceWriter(path, header()) as w:
        w.record(1, [[1, 2]])
        w.record(3, [[3, 4]])
        w.end_step()
    with TraceWriter(path, header(), append=True) as w:
        w.record(1, [[5, 6]])
        w.record(3, [[7, 8]])
        w.end_step()
    assert [s[1].topk_ids.tolist() for s in read_trace(path)] == [[[3, 4]], [[7, 8]]]
    with pytest.raises(TraceError, match="header differs"):
        TraceWriter(path, header(model="other"), append=True)
    # A crash in the middle of a record: what came before still reads.
    path.write_bytes(path.read_bytes()[:-4])
    steps = read_trace(path).steps()
    assert len(steps) == 2 and [r.layer for r in steps[1]] == [1]


def test_corrupt_files_raise_trace_error(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(TraceError, match="no such trace file"):
        read_trace(missing)
    bad = tmp_path / "bad"
    bad.write_bytes(b"NOTATRACE" + bytes(20))
    with pytest.raises(TraceError, match="bad magic"):
        read_trace(bad)
    bad.write_bytes(b"MOETRACE" + struct.pack("<HI", 9, 2) + b"{}")
    with pytest.raises(TraceError, match="version 9"):
        read_trace(bad)
    bad.write_bytes(b"MOETRACE" + struct.pack("<HI", 1, 5) + b"{oops")
    with pytest.raises(TraceError, match="not valid JSON"):
        read_trace(bad)
    bad.write_bytes(b"MOETRACE" + struct.pack("<HI", 1, 2) + b"{}")
    with pytest.raises(TraceError, match="bad trace header"):
        read_trace(bad)
    good = tmp_path / "good"
    with TraceWriter(good, header()) as w:
        w.record(1, [[1, 2]])
        w.end_step()
    blob = bytearray(good.read_bytes())
    blob[-1] = 0x7F  # the END_STEP byte becomes an unknown record type
    bad.write_bytes(bytes(blob))
    with pytest.raises(TraceError, match="unknown record type"):
        read_trace(bad).steps()


def test_writer_validates_input(tmp_path):
    with TraceWriter(tmp_path / "t", header()) as w:
        with pytest.raises(TraceError, match="moe_layers"):
            w.record(0, [[1, 2]])
        with pytest.raises(TraceError, match="out of range"):
            w.record(1, [[1, 300]])
        with pytest.raises(TraceError, match="integer"):
            w.record(1, np.array([[0.5, 1.0]]))
    with pytest.raises(TraceError):
        header(moe_layers=(1, 9))
