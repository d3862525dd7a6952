"""moeserve replicas on Ray Serve (server/ray_serve.py) on loopback: two replicas of the tiny model serve a mixed load
with no error and the single server's greedy answers; a replica killed with SIGKILL is routed around and replaced.
The settings are checked before anything starts. Needs the `moeserve[ray]` extra (`make test` installs only .[dev]:
then these are skipped)."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from moeserve.errors import ConfigError
from tests.cpu_emulation import child_pythonpath
from tests.server.conftest import HANG_GUARD_S, MODEL_NAME, REPO, ThreadServer, free_socket
from tests.server.replica_load import SESSION_HEADER, send, send_all

pytest.importorskip("ray.serve", reason="needs the moeserve[ray] extra (ray[serve]); make test installs .[dev] only")
pytestmark = pytest.mark.slow

import ray  # noqa: E402
from ray import serve  # noqa: E402

from moeserve.server.ray_serve import app_builder  # noqa: E402

MARK = "REPLICA_TEST_MARK"  # in the replicas' environment: finds this test's replica processes


class Replicas:
    def __init__(self, url: str, mark: str) -> None:
        self.url, self.mark = url, mark

    def pids(self) -> set[int]:
        """This cluster's replica processes (Ray names them ServeReplica:APP:DEPLOYMENT)."""
        found = set()
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                if (b"ServeReplica:moeserve" in Path(f"/proc/{entry}/cmdline").read_bytes()
                        and f"{MARK}={self.mark}".encode() in Path(f"/proc/{entry}/environ").read_bytes()):
                    found.add(int(entry))
            except OSError:
                continue
        return found

    @staticmethod
    def running() -> int:
        return int(serve.status().applications["moeserve"].deployments["moeserve"].replica_states.get("RUNNING", 0))


@pytest.fixture(scope="module")
def replicas(tiny_text_model: Path) -> Iterator[Replicas]:
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    mark = uuid.uuid4().hex
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", child_pythonpath(REPO))  # the replicas import this checkout's moeserve
        env.setenv(MARK, mark)
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="warning")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = app_builder({"model": str(tiny_text_model), "served_model_name": [MODEL_NAME], "dtype": "float32",
                           "threads": 1, "max_num_seqs": 16, "num_replicas": 2, "num_cpus": 0.5})
        serve.run(app, name="moeserve", route_prefix="/", blocking=False)
        yield Replicas(f"http://127.0.0.1:{port}", mark)
    finally:
        serve.shutdown()
        ray.shutdown()


def test_two_replicas_serve_a_mixed_load_with_the_single_server_s_answers(
        replicas: Replicas, live_server: ThreadServer) -> None:
    assert len(replicas.pids()) == 2 and replicas.running() == 2
    count = 24
    served = send_all(replicas.url, count)
    assert [status for status, _ in served] == [200] * count, [s for s in served if s[0] != 200][:3]
    alone = [send(live_server.url, i) for i in range(count)]  # one server, one request at a time
    assert served == alone


def _finished(url: str, session: str) -> float:
    """Requests finished by the replica a session reaches (its own /metrics, routed by the session header)."""
    lines = httpx.get(url + "/metrics", headers={SESSION_HEADER: session}, timeout=60).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("moeserve:request_success_total"))


def test_a_session_s_requests_all_reach_one_replica(replicas: Replicas) -> None:
    """Every turn of a conversation lands on the replica that holds its prefix (6 of 6; spread evenly over two
    replicas, about 3 would)."""
    for session in ("alice", "bob"):
        before = _finished(replicas.url, session)
        messages: list[dict[str, str]] = []
        for turn in range(6):
            messages.append({"role": "user", "content": f"Turn {turn}: tell me more."})
            reply = httpx.post(replicas.url + "/v1/chat/completions", headers={SESSION_HEADER: session}, timeout=300,
                               json={"model": MODEL_NAME, "messages": messages, "max_tokens": 3, "temperature": 0})
            assert reply.status_code == 200, reply.text
            messages.append({"role": "assistant", "content": reply.json()["choices"][0]["message"]["content"]})
        assert _finished(replicas.url, session) - before == 6


def test_a_killed_replica_is_routed_around_and_replaced(replicas: Replicas) -> None:
    before = replicas.pids()
    assert len(before) == 2
    stop = threading.Event()
    outcomes: list[tuple[float, int, str]] = []  # (start time, status, text)

    def load(first: int) -> None:
        i = first
        while not stop.is_set():
            started = time.monotonic()
            outcomes.append((started, *send(replicas.url, i)))
            i += 4

    threads = [threading.Thread(target=load, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    while len(outcomes) < 8:  # the load runs on both replicas
        time.sleep(0.05)
    killed = sorted(before)[0]
    killed_at = time.monotonic()
    os.kill(killed, signal.SIGKILL)
    deadline = killed_at + HANG_GUARD_S
    while not (replicas.pids() - before and replicas.running() == 2) and time.monotonic() < deadline:
        time.sleep(0.1)
    replaced_s = time.monotonic() - killed_at
    more = len(outcomes) + 8  # and it keeps serving on the new replica set
    while len(outcomes) < more and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join()
    after = replicas.pids()
    assert killed not in after and len(after) == 2 and replicas.running() == 2, (after, replaced_s)
    failed = [o for o in outcomes if o[1] != 200]
    # Only requests in flight on the killed replica are lost (at most one per load thread), none started later.
    assert len(failed) <= len(threads) and all(started < killed_at for started, _, _ in failed), failed
    assert sum(1 for started, status, _ in outcomes if started > killed_at and status == 200) >= 8
    print(f"\nSIGKILLed replica replaced in {replaced_s:.1f} s; {len(outcomes)} requests, {len(failed)} failed "
          f"(in flight on it); load average {os.getloadavg()[0]:.1f}")


def test_waiting_requests_add_a_replica(replicas: Replicas, tiny_text_model: Path) -> None:
    """Two clients on one-slot replicas: the engine's queue (a request waits) asks for a second replica. Ray's own
    policy would not: 2 requests in flight is its default target for one replica."""
    app = app_builder({"model": str(tiny_text_model), "served_model_name": [MODEL_NAME], "dtype": "float32",
                       "threads": 1, "max_num_seqs": 1, "num_replicas": 1, "min_replicas": 1, "max_replicas": 2,
                       "upscale_delay_s": 1, "num_cpus": 0.5})
    serve.run(app, name="scaling", route_prefix="/scaling", blocking=False)
    url = replicas.url + "/scaling"
    body = {"model": MODEL_NAME, "prompt": "It is", "max_tokens": 24, "ignore_eos": True}
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            assert httpx.post(url + "/v1/completions", json=body, timeout=300).status_code == 200

    def running() -> int:
        states = serve.status().applications["scaling"].deployments["moeserve"].replica_states
        return int(states.get("RUNNING", 0))

    threads = [threading.Thread(target=load) for _ in range(2)]
    try:
        assert running() == 1
        started = time.monotonic()
        for t in threads:
            t.start()
        while running() < 2 and time.monotonic() < started + HANG_GUARD_S:
            time.sleep(0.2)
        assert running() == 2
        print(f"\nscaled from 1 to 2 replicas {time.monotonic() - started:.1f} s after the load began; load "
              f"average {os.getloadavg()[0]:.1f}")
    finally:
        stop.set()
        for t in threads:
            t.join()
        serve.delete("scaling")


def test_settings_are_checked_before_anything_is_deployed(tiny_text_model: Path) -> None:
    with pytest.raises(ConfigError, match="did you mean 'num_replicas'"):
        app_builder({"model": str(tiny_text_model), "num_replica": 2})
    with pytest.raises(ConfigError, match="port is not a setting under Ray Serve"):
        app_builder({"model": str(tiny_text_model), "port": 8000})
    with pytest.raises(ConfigError, match="between min_replicas"):
        app_builder({"model": str(tiny_text_model), "num_replicas": 5, "max_replicas": 3})
