"""Live servers for the server tests.

`ThreadServer` runs uvicorn on a thread of the test process (fast: torch is already imported) on a socket bound to
a free port of 127.0.0.1. `start_subprocess_server` runs `python -m moeserve serve` in a child process, for what
needs a real process (SIGTERM, peak RSS, networking off). Both serve the tiny Qwen3-MoE checkpoint with a
tokenizer and ChatML template that tests/conftest.py builds (`tiny_text_model`).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from moeserve.config import EngineSettings, ServerSettings, build_settings
from moeserve.engine.async_engine import AsyncEngine
from moeserve.engine.llm_engine import LLMEngine
from moeserve.server.app import build_app
from moeserve.server.metrics import ServerMetrics
from moeserve.server.state import ServerState
from tests.cpu_emulation import child_pythonpath

MODEL_NAME = "tiny"
REPO = Path(__file__).resolve().parents[2]


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def make_state(make_engine: Callable[[], Any], max_in_flight: int = 72, **server: Any) -> ServerState:
    settings: ServerSettings = build_settings(ServerSettings, server)
    return ServerState(AsyncEngine(make_engine, max_in_flight), settings, MODEL_NAME, ServerMetrics(MODEL_NAME))


class ThreadServer:
    """uvicorn serving build_app(state) on a background thread; `url` is http://127.0.0.1:PORT."""

    def __init__(self, state: ServerState, wait_ready: bool = True) -> None:
        self.state = state
        self.sock = free_socket()
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(build_app(state), log_level="warning", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + HANG_GUARD_S
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("test server did not start")
            time.sleep(0.01)
        if wait_ready:
            wait_healthy(self.url, alive=self.thread.is_alive)

    def client(self, **kwargs: Any) -> Any:
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=kwargs.pop("api_key", "none"), max_retries=0,
                             **kwargs)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


HANG_GUARD_S = 1800.0  # not a speed limit: readiness is the signal, this only ends a server that hangs


def wait_healthy(url: str, timeout: float = HANG_GUARD_S, proc: subprocess.Popen[str] | None = None,
                 alive: Callable[[], bool] | None = None) -> None:
    """Until /health answers 200; raises at once when `proc` (the server's process) exits or `alive()` turns
    false (a thread server whose thread died), and at the hang guard otherwise: a slow load only waits longer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            raise RuntimeError(f"the server at {url} stopped before it was healthy")
        if proc is not None and proc.poll() is not None:
            output = proc.stdout.read()[-3000:] if proc.stdout is not None else ""
            raise RuntimeError(f"the server exited with {proc.returncode} before it was healthy:\n{output}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not become healthy in {timeout}s")


def engine_factory(model: Path, **settings: Any) -> Callable[[], LLMEngine]:
    engine_settings: EngineSettings = build_settings(EngineSettings, {
        "model": str(model), "dtype": "float32", "threads": 1, **settings})
    return lambda: LLMEngine(engine_settings)


@pytest.fixture(scope="session")
def live_server(tiny_text_model: Path) -> Iterator[ThreadServer]:
    """One shared server on the tiny model (max_num_seqs 16): tests must leave it idle."""
    server = ThreadServer(make_state(engine_factory(tiny_text_model, max_num_seqs=16)))
    yield server
    server.stop()


@pytest.fixture
def thread_server() -> Iterator[Callable[..., ThreadServer]]:
    """Factory for private servers (stopped at the end of the test)."""
    servers: list[ThreadServer] = []

    def start(state: ServerState, wait_ready: bool = True) -> ThreadServer:
        servers.append(ThreadServer(state, wait_ready))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


def start_subprocess_server(model: Path, *extra: str, env: dict[str, str] | None = None,
                            prefix: tuple[str, ...] = ()) -> tuple[subprocess.Popen[str], str]:
    """`moeserve serve MODEL --port P ...` in a child process; returns (process, url). Output goes to a pipe."""
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()  # a tiny race with other processes; acceptable on a test machine
    cmd = [*prefix, sys.executable, "-m", "moeserve", "serve", str(model), "--port", str(port),
           "--served-model-name", MODEL_NAME, "--dtype", "float32", "--threads", "1", *extra]
    child_env = {**os.environ, "PYTHONPATH": child_pythonpath(REPO), **(env or {})}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env,
                            cwd=REPO)
    return proc, f"http://127.0.0.1:{port}"


def stop_subprocess_server(proc: subprocess.Popen[str], timeout_s: float = 30) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout_s`."""
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
