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

from moeserve.memory.split import process_rss_bytes
from tests.cpu_emulation import child_pythonpath

REPO = Path(__file__).resolve().parents[2]


JOIN_TIMEOUT_S = 60.0  # a rank that cannot join fails its test within this, not the default 300 s


def in_process_gb(own_gb: float) -> float:
    """memory_gb for an engine in this (the test) process: `own_gb` plus what the process holds now. An engine
    counts its whole process's RSS against memory_gb, and earlier tests leave a pytest process at gigabytes (the
    last CI's heads were refused: 'runtime 3.44 GiB ... exceed memory_gb=1.5'). A worker is a process of its own
    and keeps its real budget."""
    return own_gb + process_rss_bytes() / 2**30


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
                    "ep_join_timeout", "max_num_batched_tokens", "cache_policy"):
            flag = "--" + name.replace("_", "-")
            flags += [flag] if value is True else [f"--no-{flag[2:]}"] if value is False else [flag, str(value)]
    return flags


def start_worker(model: Path, head: str, memory_gb: float, *flags: str,
                 prefix: tuple[str, ...] = ()) -> subprocess.Popen[str]:
    """`moeserve ep-worker` in a child process (`prefix`: e.g. `ip netns exec NS`, which execs it in place)."""
    cmd = [*prefix, sys.executable, "-m", "moeserve", "ep-worker", str(model), "--head", head, "--memory-gb",
           str(memory_gb), *flags]
    env = {**os.environ, "PYTHONPATH": child_pythonpath(REPO)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    SAMPLERS[proc.pid] = PeakSampler(proc.pid)
    return proc


class PeakSampler:
    """A child's peak RSS: its VmHWM (its own address space's high-water mark), read every 20 ms from its spawn
    until it is reaped. Not os.wait4's ru_maxrss: Linux carries the spawning process's high-water mark into the
    child's at exec, so under a pytest process that earlier tests left at gigabytes every child read as that."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self.done = pid, 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.is_set():
            try:
                self.peak = max(self.peak, peak_rss_bytes(self.pid))
            except OSError:  # reaped
                return
            self.done.wait(0.02)

    def stop(self) -> int:
        self.done.set()
        self.thread.join()
        return self.peak


SAMPLERS: dict[int, PeakSampler] = {}  # pid -> its sampler, from start_worker to reap


def reap(proc: subprocess.Popen[str], timeout_s: float = 120) -> tuple[int, int, str]:
    """(exit status, peak RSS in bytes (PeakSampler), output) of a child that is exiting; killed if it has not
    exited within `timeout_s` (a hang guard)."""
    guard = threading.Timer(timeout_s, proc.kill)
    guard.start()
    try:
        output = proc.stdout.read() if proc.stdout is not None else ""
        _, status, _usage = os.wait4(proc.pid, 0)
    finally:
        guard.cancel()
    peak = SAMPLERS.pop(proc.pid).stop()
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, peak, output


def workers_said(reaped: list[tuple[int, int, str]]) -> str:
    """What reaped workers printed (exit status, the end of their output), for a failed test's message."""
    return "\n".join(f"worker {i + 1} exited with {status}:\n{output[-1500:]}"
                     for i, (status, _, output) in enumerate(reaped))


def peak_rss_bytes(pid: int) -> int:
    """VmHWM of a live process (its peak resident set so far), bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


