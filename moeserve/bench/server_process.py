"""`moeserve serve` in a child process on a free loopback port, for the benchmarks and checks that drive it over HTTP
(`moeserve bench serve`, research/serve_invariance_check.py, scripts/demo.py)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import TracebackType
from typing import Any

import moeserve

# The child imports the same moeserve as this process (a checkout that is not installed, a git worktree).
PACKAGE_ROOT = Path(moeserve.__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port free on the loopback interface at the moment of asking."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 600) -> None:
    """Return once `url`/health answers 200; SystemExit naming why if `proc` exits first or `timeout_s` passes."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with status {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"the server did not become healthy within {timeout_s:.0f} s")


class ServerProcess:
    """`with ServerProcess(model, "bench", [...]) as server:` a healthy server at `server.url`; stopped (SIGTERM, its
    exit status in `exit_status`) when the block ends. `quiet` sends its output to /dev/null."""

    def __init__(self, model: Path | str, served_model_name: str, serve_args: list[str] | None = None,
                 quiet: bool = True) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "moeserve", "serve", str(model), "--port", str(self.port),
                    "--served-model-name", served_model_name, *(serve_args or [])]
        self.quiet = quiet
        self.exit_status: int | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ServerProcess:
        out = subprocess.DEVNULL if self.quiet else None
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(PACKAGE_ROOT),
                                                                         os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen(self.cmd, env=env, stdout=out, stderr=out)
        try:
            wait_healthy(self.url, self.proc)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> int:
        """SIGTERM, then wait (60 s) for the exit; returns the exit status."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self.exit_status = self.proc.wait(60)
        return self.exit_status

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


async def stream_choices(client: Any, url: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """choices[0] of each data chunk of a streamed /v1/completions request (`body` + stream=True), as it arrives;
    `client` is an httpx.AsyncClient."""
    async with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])["choices"][0]
