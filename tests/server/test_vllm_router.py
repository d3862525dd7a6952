"""moeserve behind vLLM's router (`vllm-router`, the binary of the PyPI package) on loopback: two `moeserve serve`
processes of the tiny model, the router in front. The router rewrites every request with its vLLM/SGLang fields
(request_fields.ROUTER_FIELDS): a mixed load passes with no error and each server's greedy answers, both servers
serve, and a value moeserve cannot honour comes back as moeserve's 400 naming it. Skipped without `vllm-router`."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import (
    HANG_GUARD_S,
    MODEL_NAME,
    free_socket,
    start_subprocess_server,
    stop_subprocess_server,
    wait_healthy,
)
from tests.server.replica_load import send, send_all

ROUTER = shutil.which("vllm-router") or shutil.which("vllm-router", path=str(Path(sys.executable).parent))
pytestmark = [pytest.mark.slow, pytest.mark.skipif(ROUTER is None, reason="needs vllm-router (pip install "
                                                   "vllm-router); make test installs .[dev] only")]


@pytest.fixture(scope="module")
def routed(tiny_text_model: Path) -> Iterator[tuple[str, list[str]]]:
    """(the router's URL, the servers' URLs)."""
    servers = [start_subprocess_server(tiny_text_model, "--max-num-seqs", "16") for _ in range(2)]
    port, metrics_port = _free_port(), _free_port()
    router = None
    try:
        for proc, url in servers:
            wait_healthy(url, proc=proc)
        assert ROUTER is not None
        router = subprocess.Popen([ROUTER, "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
                                   "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
                                   "--health-check-endpoint", "/health?strict=true",
                                   "--worker-urls", *[url for _, url in servers]],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_routing(f"http://127.0.0.1:{port}", router)
        yield f"http://127.0.0.1:{port}", [url for _, url in servers]
    finally:
        if router is not None:
            router.terminate()
            router.wait(30)
        for proc, _ in servers:
            stop_subprocess_server(proc)


def _free_port() -> int:
    sock = free_socket()
    port = int(sock.getsockname()[1])
    sock.close()
    return port


def _wait_routing(url: str, router: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:
        if router.poll() is not None:
            raise RuntimeError(f"vllm-router exited with {router.returncode}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError("vllm-router did not start")


def _served(url: str) -> float:
    """Requests a server finished (its /metrics)."""
    lines = httpx.get(url + "/metrics").text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("moeserve:request_success_total"))


def test_a_mixed_load_through_the_router_gets_each_server_s_answers(routed: tuple[str, list[str]]) -> None:
    router, servers = routed
    count = 16
    before = [_served(url) for url in servers]
    through = send_all(router, count)
    assert [status for status, _ in through] == [200] * count, [t for t in through if t[0] != 200][:3]
    assert all(_served(url) > b for url, b in zip(servers, before))  # round robin: both served
    assert through == [send(servers[i % 2], i) for i in range(count)]  # each server alone gives the same answers


def test_a_field_moeserve_cannot_honour_is_named_in_the_400_through_the_router(
        routed: tuple[str, list[str]]) -> None:
    router, _ = routed
    body = {"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}], "no_stop_trim": True}
    reply = httpx.post(router + "/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400
    assert reply.json()["error"]["message"].startswith("no_stop_trim=true is not supported")
