"""Expert-parallel runs on 127.0.0.1 for the tests: `moeserve ep-worker` child processes joined to a head (an engine
in this process, or a `moeserve serve` child), and their peak RSS."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from tests.cpu_emulation import child_pythonpath

REPO = Path(__file__).resolve().parents[2]


def free_address() -> str:
    """127.0.0.1:PORT of a port free just now (a tiny race with other processes; acceptable on a test machine)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def worker_flags(settings: dict[str, Any]) -> list[str]:
    """The engine flags of `settings` (the numerics ones a worker must share with its head)."""
    flags = []
    for name, value in settings.items():
        if name in ("dtype", "kernels", "batch_invariant", "quantization", "expert_layout", "threads", "ep_timeout",
                    "max_num_batched_tokens", "cache_policy"):
            flag = "--" + name.replace("_", "-")
            flags += [flag] if value is True else [f"--no-{flag[2:]}"] if value is False else [flag, str(value)]
    return flags


def start_worker(model: Path, head: str, memory_gb: float, *flags: str,
                 prefix: tuple[str, ...] = ()) -> subprocess.Popen[str]:
    """`moeserve ep-worker` in a child process (`prefix`: e.g. `ip netns exec NS`, which execs it in place)."""
    cmd = [*prefix, sys.executable, "-m", "moeserve", "ep-worker", str(model), "--head", head, "--memory-gb",
           str(memory_gb), *flags]
    env = {**os.environ, "PYTHONPATH": child_pythonpath(REPO)}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)


def reap(proc: subprocess.Popen[str], timeout_s: float = 120) -> tuple[int, int, str]:
    """(exit status, peak RSS in bytes, output) of a child that is exiting, reaped with os.wait4 for its own
    rusage (ru_maxrss, KiB on Linux); killed if it has not exited within `timeout_s` (a hang guard)."""
    guard = threading.Timer(timeout_s, proc.kill)
    guard.start()
    try:
        output = proc.stdout.read() if proc.stdout is not None else ""
        _, status, usage = os.wait4(proc.pid, 0)
    finally:
        guard.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_maxrss * 1024, output


def peak_rss_bytes(pid: int) -> int:
    """VmHWM of a live process (its peak resident set so far), bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


