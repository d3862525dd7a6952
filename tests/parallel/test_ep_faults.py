"""Expert parallelism's faults, with `moeserve serve` as the head and one `moeserve ep-worker`, both real processes
on 127.0.0.1 with --ep-timeout 2: a worker killed (SIGKILL) or frozen (SIGSTOP) mid-stream becomes an error event on
the open stream within the timeout + 1 s, and /health?strict=true answers 503 afterwards: never a hang, never a
wrong number. Before the fault, each rank's peak RSS is within its own memory_gb."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable

import httpx
import pytest

from moeserve.engine.llm_engine import demo_model_path
from tests.parallel.cluster import free_address, peak_rss_bytes, reap, start_worker
from tests.server.conftest import MODEL_NAME, start_subprocess_server, stop_subprocess_server, wait_healthy

pytestmark = pytest.mark.slow

TIMEOUT_S = 2.0
HEAD_GB, WORKER_GB = 1.5, 0.9


def stream_until_error(url: str, fault: Callable[[], None]) -> tuple[int, float]:
    """Stream a long greedy completion, call `fault()` after 3 chunks, read on: (chunks before the fault, seconds
    from the fault to the stream's error event)."""
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    chunks, faulted_at = 0, None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                assert faulted_at is not None, chunk
                assert "expert parallelism" in chunk["error"]["message"], chunk
                return chunks, time.monotonic() - faulted_at
            chunks += 1
            if chunks == 3:
                fault()
                faulted_at = time.monotonic()
    raise AssertionError("the stream ended without an error event")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
def test_a_lost_worker_is_an_error_within_the_timeout(sig: signal.Signals) -> None:
    address = free_address()
    model = demo_model_path()
    head, url = start_subprocess_server(model, "--memory-gb", str(HEAD_GB), "--ep-listen", address,
                                        "--ep-workers", "1", "--ep-timeout", str(TIMEOUT_S), "--max-num-seqs", "2")
    worker = start_worker(model, address, WORKER_GB, "--dtype", "float32", "--threads", "1", "--ep-timeout",
                          str(TIMEOUT_S))
    try:
        wait_healthy(url, proc=head)
        assert peak_rss_bytes(head.pid) <= HEAD_GB * 2**30
        assert peak_rss_bytes(worker.pid) <= WORKER_GB * 2**30
        chunks, seconds = stream_until_error(url, lambda: os.kill(worker.pid, sig))
        assert chunks == 3 and seconds <= TIMEOUT_S + 1, f"the error came {seconds:.1f} s after {sig.name}"
        health = httpx.get(url + "/health", params={"strict": "true"}, timeout=10)
        assert health.status_code == 503 and "expert parallelism" in health.text, health.text
    finally:
        os.kill(worker.pid, signal.SIGKILL)
        reap(worker)
        stop_subprocess_server(head)
