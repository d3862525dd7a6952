"""A failing side channel never stops generation (issue 20): a full disk under --record-trace disables recording
with one error line; requests keep succeeding and /health stays 200."""

from __future__ import annotations

import errno
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest

from moeserve.experts.traces.moetrace import FailSafeWriter
from tests.server.conftest import MODEL_NAME, engine_factory, make_state


def disk_full(*_: Any, **__: Any) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


class FullDiskWriter:
    def __init__(self) -> None:
        self.records = 0
        self.closed = False

    def record(self, layer: int, topk_ids: Any, predicted_next: Any = None) -> None:
        self.records += 1
        if self.records > 2:
            disk_full()

    def end_step(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True
        disk_full()


def test_a_failing_trace_write_disables_recording_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    inner = FullDiskWriter()
    disabled: list[bool] = []
    writer = FailSafeWriter(inner, "/trace.bin", lambda: disabled.append(True))
    for layer in range(10):
        writer.record(layer, [[0, 1]])
        writer.end_step()
    writer.close()
    assert inner.records == 3 and inner.closed and writer.disabled and disabled == [True]
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "No space left on device" in errors[0].getMessage()
    assert errors[0].exc_info is None


class FullDiskFile:
    def write(self, data: bytes) -> int:
        disk_full()
        return 0

    flush = close = disk_full


def test_a_full_disk_under_record_trace_keeps_serving(tiny_text_model: Path, thread_server: Any, tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    trace = tmp_path / "routing.moetrace"
    server = thread_server(make_state(engine_factory(tiny_text_model, record_trace=str(trace))))
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
    llm = server.state.llm
    llm.trace._writer._file = FullDiskFile()  # the disk fills up now
    for stream in (False, True, False):
        response = httpx.post(server.url + "/v1/completions", json={**body, "stream": stream}, timeout=60)
        assert response.status_code == 200 and "error" not in response.text
        assert httpx.get(server.url + "/health").status_code == 200
    assert llm.trace.disabled
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "record_trace" in errors[0].getMessage(), [r.getMessage() for r in errors]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full")
def test_record_trace_on_a_really_full_device(tiny_text_model: Path, thread_server: Any,
                                              caplog: pytest.LogCaptureFixture) -> None:
    """The same with real writes: /dev/full opens, then every flush fails with ENOSPC (the file object buffers
    8 KiB, so the first failure comes after a few requests' worth of routing)."""
    caplog.set_level(logging.INFO)
    server = thread_server(make_state(engine_factory(tiny_text_model, record_trace="/dev/full")))
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 32, "temperature": 0,
            "ignore_eos": True}
    llm = server.state.llm
    for _ in range(200):  # bounded: 8 KiB of routing records take far fewer
        response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 200
        if llm.trace.disabled:
            break
    assert llm.trace.disabled
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "No space left on device" in errors[0].getMessage()
