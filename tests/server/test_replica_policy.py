"""The replica autoscaling policy (server/replica_policy.py), without Ray: the queue gauges read from a real /metrics,
the replicas asked for from the engines' queues; and Ray stays out of `import moeserve`."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from moeserve.server.replica_policy import (
    RUNNING,
    SLOTS,
    WAITING,
    desired_replicas,
    queue_depth_policy,
    queue_gauges,
)
from tests.server.conftest import ThreadServer

PACKAGE = Path(__file__).resolve().parents[2] / "moeserve"


def test_the_queue_gauges_are_read_from_the_server_s_metrics(live_server: ThreadServer) -> None:
    text = httpx.get(live_server.url + "/metrics").text
    assert queue_gauges(text) == {RUNNING: 0.0, WAITING: 0.0}  # idle (vLLM's aliases of the gauges not added in)
    labelled = 'moeserve:num_requests_waiting{model_name="a"} 3\nmoeserve:num_requests_waiting{model_name="b"} 4\n'
    assert queue_gauges(labelled + "moeserve:num_requests_running 2\n") == {RUNNING: 2.0, WAITING: 7.0}
    with pytest.raises(ValueError, match="num_requests_running"):
        queue_gauges(labelled)


def test_replicas_follow_the_batches_the_queued_requests_fill() -> None:
    def metrics(running: list[float], waiting: list[float], slots: float = 8) -> dict[str, dict[str, float]]:
        ids = [f"r{i}" for i in range(len(running))]
        return {RUNNING: dict(zip(ids, running)), WAITING: dict(zip(ids, waiting)), SLOTS: dict.fromkeys(ids, slots)}

    assert desired_replicas(metrics([8, 8], [0, 0]), 2) == 2  # full, nobody waits: stay
    assert desired_replicas(metrics([8, 8], [5, 0]), 2) == 3  # requests wait for a slot: one more
    assert desired_replicas(metrics([8, 8], [20, 9]), 2) == 6
    assert desired_replicas(metrics([3, 2], [0, 0]), 2) == 1  # fits one batch: one fewer
    assert desired_replicas(metrics([0, 0], [0, 0]), 2) == 0  # idle (Ray holds min_replicas)
    assert desired_replicas({}, 3) == 3  # nothing reported yet: no decision
    ctx = SimpleNamespace(aggregated_metrics=metrics([8], [1]), current_num_replicas=1)
    assert queue_depth_policy(ctx) == (2, {})


def test_ray_is_imported_only_by_the_ray_serve_module_and_nothing_imports_it() -> None:
    """`import moeserve` (any command, the server) never imports Ray: only the optional deployment module does."""
    imports_ray = re.compile(r"^\s*(?:import|from)\s+ray(?:[.\s]|$)", re.MULTILINE)
    imports_module = re.compile(r"^\s*(?:import|from)\s+\S*\bray_serve\b|^\s*from\s+\S+\s+import\s.*\bray_serve\b",
                                re.MULTILINE)
    found = {path.name: path.read_text() for path in PACKAGE.rglob("*.py")}
    assert imports_ray.search(found["ray_serve.py"])  # the pattern sees an import of Ray
    assert [name for name, text in found.items() if imports_ray.search(text)] == ["ray_serve.py"]
    assert [name for name, text in found.items() if imports_module.search(text)] == []
