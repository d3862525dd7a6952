"""The bench drops the files it wrote from the page cache (fsync, then POSIX_FADV_DONTNEED), measured with mincore;
failures are reported, never raised; the report says which engines a memory limit did not bound."""

from __future__ import annotations

import os

import pytest

from moeserve.bench import report
from moeserve.memory import pagecache


def _written(path, nbytes: int = 8 << 20):
    path.write_bytes(os.urandom(nbytes))
    return path


def test_a_file_just_written_is_resident_and_dropping_it_empties_the_cache(tmp_path):
    path = _written(tmp_path / "w.bin")
    before = pagecache.resident_bytes(path)
    if before is None:
        pytest.skip("mincore is not available here")
    assert before == 8 << 20  # a file just written is in the page cache, every page of it
    got = pagecache.drop([tmp_path])  # a folder: every file in it
    if got.resident_after == before:
        pytest.skip("this file system keeps the pages of its files (tmpfs?)")
    assert got.files == 1 and got.problems == []
    assert got.resident_before == before and got.resident_after == 0 == pagecache.resident_bytes(path)
    path.read_bytes()
    assert pagecache.resident_bytes(path) == before  # reading brings it back: the measure is live
    assert "8 MiB in the page cache before, 0 MiB after" in got.describe()


def test_drop_fsyncs_then_advises_dontneed_on_the_whole_file(tmp_path, monkeypatch):
    calls: list[tuple] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(("fsync",)), real_fsync(fd))[1])
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, length, advice: calls.append(("fadvise", off, length,
                                                                                              advice)))
    got = pagecache.drop([_written(tmp_path / "a.bin", 4096), _written(tmp_path / "b.bin", 4096)])
    assert got.files == 2
    assert calls == [("fsync",), ("fadvise", 0, 0, os.POSIX_FADV_DONTNEED)] * 2


def test_failures_are_reported_one_line_each_and_never_raised(tmp_path, monkeypatch):
    got = pagecache.drop([tmp_path / "missing.gguf"])
    assert got.files == 0 and len(got.problems) == 1 and "missing.gguf" in got.problems[0]

    def refuse(*_):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "posix_fadvise", refuse)
    got = pagecache.drop([_written(tmp_path / "x.bin", 4096)])
    assert got.problems == [f"{tmp_path / 'x.bin'}: Invalid argument"] and "1 failed" in got.describe()
    monkeypatch.delattr(os, "posix_fadvise")
    got = pagecache.drop([tmp_path / "x.bin"])
    assert "posix_fadvise is not available" in got.problems[0]


def _summary(limit, rss, charged) -> dict:
    row = {"case": "decode-b1", "engine": "llama.cpp", "peak_rss_bytes": rss, "memory_peak_bytes": charged}
    return {"settings": {"memory_limit_bytes": limit}, "rows": [row]}


def test_a_run_the_limit_did_not_bound_is_named():
    gib = 2**30
    # the measurement: llama.cpp under 4 GiB with 7.4 GiB resident and 0.18 GiB charged
    notes = report.unbounded_notes(_summary(4 * gib, int(7.4 * gib), int(0.18 * gib)))
    assert len(notes) == 1 and notes[0].startswith("NOT BOUNDED: decode-b1 llama.cpp: peak RSS 7.40 GiB, charged 0.18")
    assert report.unbounded_notes(_summary(4 * gib, int(3.5 * gib), int(3.4 * gib))) == []
    assert "no memory limit" in report.unbounded_notes(_summary(None, gib, None))[0]


def test_the_gguf_export_drops_the_file_it_wrote(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    from moeserve.bench import gguf_export
    from moeserve.bench.shapes import SHAPES
    from moeserve.bench.synth import ensure_checkpoint

    folder = ensure_checkpoint(SHAPES["tiny"], tmp_path)
    dropped: list = []
    real = pagecache.drop
    monkeypatch.setattr(pagecache, "drop", lambda paths: (dropped.append(list(paths)), real(dropped[-1]))[1])
    out = gguf_export.ensure_gguf(folder, SHAPES["tiny"], "bf16")
    assert dropped == [[out]]
    if pagecache.resident_bytes(out) is not None:
        assert pagecache.resident_bytes(out) == 0
    gguf_export.ensure_gguf(folder, SHAPES["tiny"], "bf16")  # already there: nothing written, nothing dropped
    assert dropped == [[out]]
