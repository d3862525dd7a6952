"""Expert parallelism's faults, with `moeserve serve` as the head and one `moeserve ep-worker`, both real processes
with --ep-timeout 2: a worker killed (SIGKILL) or frozen (SIGSTOP) mid-stream, on 127.0.0.1, or cut off (its own
network namespace behind a veth pair the test makes, whose host end goes down; needs root), becomes an error event on
the open stream within the timeout + SLACK_S (the step in flight when the fault came, on a busy machine), and
/health?strict=true answers 503 afterwards: never a hang, never a wrong number. Before the fault, each rank's peak RSS is within its own memory_gb (the head's where it is a process:
the SIGKILL case; the others run the head's server on a thread of the test process, which is cheaper)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable

import httpx
import pytest

from moeserve.engine.llm_engine import demo_model_path
from tests.parallel.cluster import (
    JOIN_TIMEOUT_S,
    free_address,
    in_process_gb,
    peak_rss_bytes,
    reap,
    start_worker,
    workers_said,
)
from tests.server.conftest import (
    MODEL_NAME,
    ThreadServer,
    engine_factory,
    make_state,
    start_subprocess_server,
    stop_subprocess_server,
    wait_healthy,
)

pytestmark = pytest.mark.slow

TIMEOUT_S = 2.0
SLACK_S = 5.0  # beyond the timeout: the engine step in flight when the fault came (1 s failed once at a load of 8)
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


class CutLink:
    """A network namespace with a veth pair, made by the test: the head listens on the host end, the worker runs
    in the namespace behind the other end; `cut()` takes the host end down (a link cut, both processes alive)."""

    def __init__(self) -> None:
        tag = os.getpid() % 100000
        self.ns, self.host_if, self.ns_if = f"ep-ns{tag}", f"ep-h{tag}", f"ep-w{tag}"
        net = f"10.{213 + tag % 40}.{tag % 250}"
        self.host_ip, self.ns_ip = f"{net}.1", f"{net}.2"
        for cmd in (["ip", "netns", "add", self.ns],
                    ["ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if],
                    ["ip", "link", "set", self.ns_if, "netns", self.ns],
                    ["ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_if],
                    ["ip", "link", "set", self.host_if, "up"],
                    ["ip", "netns", "exec", self.ns, "ip", "addr", "add", f"{self.ns_ip}/30", "dev", self.ns_if],
                    ["ip", "netns", "exec", self.ns, "ip", "link", "set", self.ns_if, "up"],
                    ["ip", "netns", "exec", self.ns, "ip", "link", "set", "lo", "up"]):
            subprocess.run(cmd, check=True, capture_output=True)

    def cut(self) -> None:
        subprocess.run(["ip", "link", "set", self.host_if, "down"], check=True)

    def close(self) -> None:
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)


def can_make_namespaces() -> bool:
    name = f"ep-probe{os.getpid()}"
    made = shutil.which("ip") is not None and subprocess.run(["ip", "netns", "add", name],
                                                              capture_output=True).returncode == 0
    if made:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return made


FAULTS = ["SIGKILL", "SIGSTOP", "cut-link"]


class Head:
    """The head: `moeserve serve` as a process (SIGKILL's case, where its peak RSS is checked too), or, cheaper, a
    server on a thread of this process (the other faults)."""

    def __init__(self, address: str, in_process: bool) -> None:
        model = demo_model_path()
        self.proc: subprocess.Popen[str] | None = None
        self.thread: ThreadServer | None = None
        if in_process:
            settings = {"memory_gb": in_process_gb(HEAD_GB), "ep_listen": address, "ep_workers": 1,
                        "ep_timeout": TIMEOUT_S,
                        "ep_join_timeout": JOIN_TIMEOUT_S,
                        "max_num_seqs": 2}
            self.thread = ThreadServer(make_state(engine_factory(model, **settings)), wait_ready=False)
            self.url = self.thread.url
        else:
            self.proc, self.url = start_subprocess_server(
                model, "--memory-gb", str(HEAD_GB), "--ep-listen", address, "--ep-workers", "1", "--ep-timeout",
                str(TIMEOUT_S), "--ep-join-timeout", str(JOIN_TIMEOUT_S), "--max-num-seqs", "2")

    def wait_healthy(self) -> None:
        if self.thread is not None:
            wait_healthy(self.url, alive=self.thread.thread.is_alive)
        else:
            wait_healthy(self.url, proc=self.proc)
            assert self.proc is not None and peak_rss_bytes(self.proc.pid) <= HEAD_GB * 2**30

    def stop(self) -> None:
        if self.thread is not None:
            self.thread.stop()
        if self.proc is not None:
            stop_subprocess_server(self.proc)


@pytest.mark.parametrize("fault", FAULTS)
def test_a_lost_worker_is_an_error_within_the_timeout(fault: str) -> None:
    link = None
    if fault == "cut-link":
        if not can_make_namespaces():
            pytest.skip("network namespaces need root (ip netns add)")
        link = CutLink()
        address, prefix = f"{link.host_ip}:{free_address().rsplit(':', 1)[1]}", ("ip", "netns", "exec", link.ns)
    else:
        address, prefix = free_address(), ()
    worker = start_worker(demo_model_path(), address, WORKER_GB, "--dtype", "float32", "--threads", "1",
                          "--ep-timeout", str(TIMEOUT_S), "--ep-join-timeout", str(JOIN_TIMEOUT_S), prefix=prefix)
    head = Head(address, in_process=fault != "SIGKILL")
    act = {"SIGKILL": lambda: os.kill(worker.pid, signal.SIGKILL),
           "SIGSTOP": lambda: os.kill(worker.pid, signal.SIGSTOP),
           "cut-link": lambda: link.cut() if link is not None else None}[fault]
    failed_to_start: Exception | None = None
    try:
        try:
            head.wait_healthy()
        except Exception as err:
            failed_to_start = err
            raise
        assert peak_rss_bytes(worker.pid) <= WORKER_GB * 2**30
        chunks, seconds = stream_until_error(head.url, act)
        assert chunks == 3 and seconds <= TIMEOUT_S + SLACK_S, f"the error came {seconds:.1f} s after {fault}"
        health = httpx.get(head.url + "/health", params={"strict": "true"}, timeout=10)
        assert health.status_code == 503 and "expert parallelism" in health.text, health.text
    finally:
        os.kill(worker.pid, signal.SIGKILL)
        reaped = reap(worker)
        head.stop()
        if link is not None:
            link.close()
        if failed_to_start is not None:  # the worker's own words say why
            raise AssertionError(f"the head did not start: {failed_to_start}\n{workers_said([reaped])}")
