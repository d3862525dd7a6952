"""How many moeserve replicas Ray Serve should run: from each replica's engine queue, as its /metrics shows it.

Pure functions (no Ray, no torch): server/ray_serve.py feeds them. A replica reports its engine's
`moeserve:num_requests_running` and `moeserve:num_requests_waiting` gauges (read from its own /metrics) and its batch
slots (max_num_seqs); the policy asks for as many replicas as the requests in them fill batches:
ceil((running + waiting) / slots). Requests waiting for a batch slot mean every slot of some replica is taken: the
demand passes the replicas' slots and one more is asked for; a demand that fits fewer batches asks for fewer. Ray
Serve applies its own bounds and delays to the answer (min_replicas, max_replicas, upscale_delay_s,
downscale_delay_s, the scaling factors), as for its built-in policy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

RUNNING, WAITING, SLOTS = "num_requests_running", "num_requests_waiting", "max_num_seqs"
GAUGE_PREFIX = "moeserve:"


def queue_gauges(metrics_text: str) -> dict[str, float]:
    """{num_requests_running, num_requests_waiting} from moeserve's /metrics text (Prometheus exposition format),
    each summed over its label sets. Raises ValueError when one is missing (not moeserve's /metrics)."""
    found: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if not line.startswith(GAUGE_PREFIX):
            continue
        name_and_labels, _, value = line.rpartition(" ")
        name = name_and_labels.split("{", 1)[0][len(GAUGE_PREFIX):]
        if name in (RUNNING, WAITING):
            found[name] = found.get(name, 0.0) + float(value)
    missing = [n for n in (RUNNING, WAITING) if n not in found]
    if missing:
        raise ValueError(f"/metrics has no {GAUGE_PREFIX}{missing[0]} gauge")
    return found


def desired_replicas(metrics: Mapping[str, Mapping[Any, float]], current: int) -> float:
    """Replicas wanted for the requests in the running replicas: `metrics` maps each reported name (RUNNING,
    WAITING, SLOTS) to {replica: value}. Before any replica has reported: `current` (no decision)."""
    slots = metrics.get(SLOTS) or {}
    if not slots:
        return float(current)
    demand = sum((metrics.get(RUNNING) or {}).values()) + sum((metrics.get(WAITING) or {}).values())
    per_replica = sum(slots.values()) / len(slots)
    return float(math.ceil(demand / per_replica)) if per_replica > 0 else float(current)


def queue_depth_policy(ctx: Any) -> tuple[float, dict[str, Any]]:
    """Ray Serve's custom autoscaling policy (`AutoscalingPolicy(policy_function=...)`): the replicas' reports are
    `ctx.aggregated_metrics` (each name -> {replica id: value averaged over Ray's look-back window})."""
    return desired_replicas(ctx.aggregated_metrics or {}, ctx.current_num_replicas), {}
