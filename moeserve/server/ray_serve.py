"""Replicas of moeserve's server on Ray Serve (the `moeserve[ray]` extra; `import moeserve` does not import Ray).

    serve run moeserve.server.ray_serve:app_builder model=/models/Qwen3-30B-A3B memory_gb=16 num_replicas=2

Each replica serves moeserve's own FastAPI app (server/app.py), built on the replica from the settings `moeserve
serve` takes (any EngineSettings or ServerSettings name, host and port apart: Ray Serve's proxy listens), so every
endpoint, error and stream is the single server's. Ray Serve runs the app's startup (the engine thread, the model
loading) and shutdown hooks. The rest is Ray Serve's, configured here:
- health: Ray calls `check_health`, which asks the app's own `/health?strict=true` (a replica loading, draining,
  dead or degraded is unhealthy; Ray routes around it and replaces it); the first check waits for the model to load;
- autoscaling (`max_replicas` set): on the engines' queues read from each replica's `/metrics`
  (server/replica_policy.py);
- routing (`affinity`): `session` (the default) is Ray's ConsistentHashRouter on the `x-session-id` header, so a
  conversation's turns reach the replica whose prefix cache and expert cache hold it; `none` is Ray's default
  (power of two choices on queue length).
Each choice is logged when the application is built, with its reason.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy

from moeserve.config import EngineSettings, ServerSettings, build_settings, split_settings
from moeserve.engine.async_engine import State
from moeserve.errors import ConfigError, MoeserveError
from moeserve.preflight import check_engine_settings
from moeserve.server.app import build_app
from moeserve.server.replica_policy import SLOTS, queue_depth_policy, queue_gauges
from moeserve.server.startup import log_loaded, make_state, with_key_from_file, with_request_memory

log = logging.getLogger("moeserve")

SESSION_ROUTER = "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter"
LOAD_POLL_S = 0.1
NOT_UNDER_RAY = ("host", "port")  # Ray Serve's proxy listens (serve run --host/--port, or http_options)


class RaySettings(BaseModel):
    """The Ray Serve side of the deployment (the rest are `moeserve serve`'s settings)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_replicas: int = Field(1, ge=1, description="replicas (the initial count when max_replicas is set)")
    max_replicas: int | None = Field(None, ge=1, description="autoscale up to this many on queue depth")
    min_replicas: int = Field(1, ge=0, description="autoscale down to this many (with max_replicas)")
    upscale_delay_s: float = Field(30.0, ge=0, description="a higher demand must last this long to add replicas")
    downscale_delay_s: float = Field(600.0, ge=0, description="a lower demand must last this long to remove one")
    affinity: Literal["session", "none"] = Field("session", description="session: a session's requests (the "
                                                 "x-session-id header) go to one replica; none: Ray's default")
    num_cpus: float = Field(1.0, gt=0, description="CPUs Ray reserves for each replica")
    health_check_period_s: float = Field(10.0, gt=0, description="seconds between health checks")
    health_check_timeout_s: float = Field(30.0, gt=0, description="a health check slower than this fails")


def log_to_stderr() -> None:
    """moeserve's log lines (its start-up choices, each with its reason) on stderr at INFO, as `moeserve serve` shows
    them: Ray configures only its own loggers, in the `serve run` process and in each replica (whose stderr Ray
    forwards to the driver's console and keeps in its worker-*.err log)."""
    logger = logging.getLogger("moeserve")
    if not any(getattr(h, "moeserve_stderr", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
        handler.moeserve_stderr = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


class MoeserveReplica:
    """One replica: the app and its engine. Ray Serve's ingress wrapper calls `__serve_build_asgi_app__` on the
    replica, runs the app's lifespan, then `check_health` and `record_autoscaling_stats` periodically."""

    def __init__(self, engine: EngineSettings, server: ServerSettings) -> None:
        log_to_stderr()
        self.engine_settings, self.server_settings = engine, server
        self.load_error: BaseException | None = None

    def __serve_build_asgi_app__(self) -> Any:
        self.state = make_state(self.engine_settings, self.server_settings, self._loaded)
        self.moeserve_app = build_app(self.state)  # its lifespan starts the engine thread (the model loads) and stops it
        return self.moeserve_app

    def _loaded(self, err: BaseException | None) -> None:
        if err is None:
            try:
                log_loaded(self.state)
            except MoeserveError as bad:
                err = bad
        if err is not None:
            log.error("error: %s", err)
            self.load_error = err

    async def check_health(self) -> None:
        """Raise unless the app's /health?strict=true answers 200; the first check (Ray's, at start-up) waits for
        the model to load."""
        while self.state.engine.state == State.LOADING:
            await asyncio.sleep(LOAD_POLL_S)
        if self.load_error is not None:
            raise RuntimeError(f"the model did not load: {self.load_error}")
        status, body = await asgi_get(self.moeserve_app, "/health?strict=true")
        if status != 200:
            raise RuntimeError(f"/health?strict=true answered {status}: {body[:300]}")

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """The engine's queue, read from the app's /metrics, and its batch slots (replica_policy.py reads them)."""
        status, body = await asgi_get(self.moeserve_app, "/metrics")
        if status != 200:
            raise RuntimeError(f"/metrics answered {status}: {body[:300]}")
        return {**queue_gauges(body), SLOTS: float(self.engine_settings.max_num_seqs)}


async def asgi_get(app: Any, target: str) -> tuple[int, str]:
    """GET `target` (path?query) from an ASGI app in this process: (status, body text)."""
    path, _, query = target.partition("?")
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": query.encode(), "root_path": "",
             "headers": [(b"host", b"localhost")], "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}
    status, chunks = 0, []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return status, b"".join(chunks).decode("utf-8", "replace")


def deployment_options(ray: RaySettings, engine: EngineSettings, server: ServerSettings) -> dict[str, Any]:
    """serve.deployment's options, each choice logged with its reason."""
    if ray.max_replicas is not None and not ray.min_replicas <= ray.num_replicas <= ray.max_replicas:
        raise ConfigError(f"num_replicas {ray.num_replicas} must lie between min_replicas {ray.min_replicas} and "
                          f"max_replicas {ray.max_replicas}")
    in_flight = engine.max_num_seqs + server.max_queued_requests
    options: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": ray.num_cpus},
        "max_ongoing_requests": in_flight,
        "health_check_period_s": ray.health_check_period_s,
        "health_check_timeout_s": ray.health_check_timeout_s,
        "graceful_shutdown_timeout_s": server.shutdown_timeout,
    }
    if engine.memory_gb is not None:
        options["ray_actor_options"]["memory"] = int(engine.memory_gb * 2**30)
        log.info("ray serve: each replica reserves %g GiB of its node's memory in Ray (memory_gb: Ray places no "
                 "more replicas on a node than its memory holds)", engine.memory_gb)
    else:
        log.info("ray serve: no memory reserved in Ray (memory_gb unset: each replica takes its node's free memory "
                 "less headroom; run one replica per node, or set memory_gb)")
    log.info("ray serve: max_ongoing_requests %d per replica (max_num_seqs %d + max_queued_requests %d: what the "
             "engine holds; beyond, Ray queues or routes elsewhere)", in_flight, engine.max_num_seqs,
             server.max_queued_requests)
    if ray.max_replicas is None:
        options["num_replicas"] = ray.num_replicas
        log.info("ray serve: %d replicas (max_replicas unset: no autoscaling)", ray.num_replicas)
    else:
        options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=ray.min_replicas, max_replicas=ray.max_replicas, initial_replicas=ray.num_replicas,
            upscale_delay_s=ray.upscale_delay_s, downscale_delay_s=ray.downscale_delay_s,
            policy=AutoscalingPolicy(policy_function=queue_depth_policy))
        log.info("ray serve: %d to %d replicas, from %d, on queue depth (each engine's running + waiting requests "
                 "from its /metrics, over its max_num_seqs batch slots)", ray.min_replicas, ray.max_replicas,
                 ray.num_replicas)
    if ray.affinity == "session":
        options["request_router_config"] = {"request_router_class": SESSION_ROUTER}
        log.info("ray serve: routing on the x-session-id header (affinity session: a session's turns reach the "
                 "replica whose prefix and expert caches hold it; requests without it spread evenly)")
    else:
        log.info("ray serve: Ray's default routing (affinity none: power of two choices on queue length)")
    log.info("ray serve: health from each replica's /health?strict=true every %gs (timeout %gs)",
             ray.health_check_period_s, ray.health_check_timeout_s)
    return options


def app_builder(args: dict[str, Any]) -> Any:
    """The application for `serve run moeserve.server.ray_serve:app_builder key=value ...` (or a Serve config's
    `args:`): moeserve serve's settings plus RaySettings. An unknown name is a ConfigError with a "did you mean"."""
    log_to_stderr()
    for name in NOT_UNDER_RAY:
        if name in args:
            raise ConfigError(f"{name} is not a setting under Ray Serve: its proxy listens (serve run --{name}, or "
                              "the Serve config's http_options)")
    engine_args, server_args, ray_args = split_settings(args, (EngineSettings, ServerSettings, RaySettings))
    server: ServerSettings = with_key_from_file(build_settings(ServerSettings, server_args))
    engine: EngineSettings = with_request_memory(build_settings(EngineSettings, engine_args), server)
    ray: RaySettings = build_settings(RaySettings, ray_args)
    check_engine_settings(engine)  # a bad setting: one line now, not in every replica's log
    deployment = serve.deployment(name="moeserve", **deployment_options(ray, engine, server))
    return deployment(serve.ingress()(MoeserveReplica)).bind(engine, server)
