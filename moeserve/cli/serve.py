"""`moeserve serve MODEL`: the OpenAI-compatible HTTP server.

The listening socket is bound first, before anything loads (a port another server holds is one line at once, and
of two servers started together on one port exactly one gets it), then handed to uvicorn; the model loads in the
engine thread meanwhile (/health answers 503 "Loading model" until it is ready, as llama.cpp does). Uvicorn's "Uvicorn running on ..." and "Application startup complete" lines
are held back until the model is loaded, so the log reads in order: model, placement and budgets with reasons,
"Loading weights took ...", the listening address, "Application startup complete". SIGTERM stops accepting
requests while the socket stays open (new requests and /health get 503 `shutting_down`), lets in-flight ones finish
for up to --shutdown-timeout seconds, then closes the socket and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import math
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import uvicorn

from moeserve.config import EngineSettings, ServerSettings, add_cli_arguments, settings_from_args
from moeserve.engine.sampling_defaults import server_sampling
from moeserve.errors import MoeserveError
from moeserve.preflight import check_engine_settings

if TYPE_CHECKING:
    from moeserve.server.connections import ServeConfig
    from moeserve.server.state import ServerState

log = logging.getLogger("moeserve")

_HELD_UVICORN_LINES = ("Uvicorn running on", "Application startup complete")
LISTEN_BACKLOG = 2048  # uvicorn's default
DRAIN_POLL_S = 0.05


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("serve", help="serve a model over the OpenAI API (HTTP)",
                            description="Serve MODEL over the OpenAI API: /v1/models, /v1/completions, "
                            "/v1/chat/completions, /health, /metrics, /tokenize, /detokenize.")
    parser.add_argument("model_path", metavar="MODEL", nargs="?", default=None,
                        help="model folder or cached Hugging Face id (default: the bundled demo model)")
    add_cli_arguments(parser, ServerSettings)
    add_cli_arguments(parser, EngineSettings, skip=("model",))
    parser.set_defaults(func=run)


class _HoldUntilLoaded(logging.Filter):
    """Holds uvicorn's 'startup complete' and 'running on' records until the model is loaded and the socket
    listens, then lets them out in reading order: the listening address, then "Application startup complete";
    then `ready(url)` runs (serve prints its one line, at any log level)."""

    def __init__(self, ready: Callable[[str], None] = lambda url: None) -> None:
        super().__init__()
        self.loaded = False
        self.released = False
        self.url: str | None = None  # set once the socket listens
        self.ready = ready
        self.held: list[logging.LogRecord] = []
        self._lock = threading.RLock()  # records come from the server thread, the load signal from the engine's

    def filter(self, record: logging.LogRecord) -> bool:
        if self.released or not record.getMessage().startswith(_HELD_UVICORN_LINES):
            return True
        with self._lock:
            self.held.append(record)
            self._maybe_release()
        return False

    def model_loaded(self) -> None:
        with self._lock:
            self.loaded = True
            self._maybe_release()

    def listening(self, url: str) -> None:
        with self._lock:
            self.url = url
            self._maybe_release()

    def _maybe_release(self) -> None:
        # uvicorn logs "running on" once the socket is open, then startup returns (`listening`): wait for that and
        # for the model. Below INFO uvicorn's records never come; the ready line is printed all the same.
        if self.released or not self.loaded or self.url is None:
            return
        self.released = True
        for record in sorted(self.held, key=lambda r: not r.getMessage().startswith(_HELD_UVICORN_LINES[0])):
            logging.getLogger(record.name).handle(record)
        self.held.clear()
        self.ready(self.url)


def run(args: argparse.Namespace) -> int:
    """Settings checked (the key file, the engine's) and the socket bound before anything loads; then serve until
    stopped."""
    from moeserve.server.startup import with_key_from_file, with_request_memory

    engine_settings: EngineSettings = settings_from_args(EngineSettings, args, model=args.model_path)
    server_settings = with_key_from_file(settings_from_args(ServerSettings, args))
    engine_settings = with_request_memory(engine_settings, server_settings)
    with bind_socket(server_settings.host, server_settings.port) as sock:  # before the model loads, not after
        check_engine_settings(engine_settings)  # a bad setting: one line now, not once the server runs
        if server_settings.generation_config not in ("auto", "vllm"):  # a folder: its file read now, not at load
            server_sampling(server_settings.generation_config, {})
        return _serve(engine_settings, server_settings, sock)


def _serve(engine_settings: EngineSettings, server_settings: ServerSettings, sock: socket.socket) -> int:
    from moeserve.server.app import build_app
    from moeserve.server.startup import log_loaded, make_state, served_names

    names = served_names(server_settings, engine_settings.model)

    def ready(url: str) -> None:  # printed at any log level: where to point a client, and with which name
        aliases = f" (also accepted: {', '.join(names[1:])})" if len(names) > 1 else ""
        print(f"moeserve: serving model '{names[0]}'{aliases} at {url}/v1", file=sys.stderr, flush=True)

    hold = _HoldUntilLoaded(ready)
    logging.getLogger("uvicorn.error").addFilter(hold)
    logging.getLogger("uvicorn.access").addFilter(_quiet_health_polls)
    outcome: dict[str, int] = {"exit_code": 0}
    server: DrainingServer | None = None
    state: ServerState | None = None

    def on_loaded(err: BaseException | None) -> None:
        if err is None:
            assert state is not None
            try:
                log_loaded(state)
            except MoeserveError as bad:
                err = bad
        if err is not None:
            log.error("error: %s", err)
            outcome["exit_code"] = 1
            if server is not None:
                server.should_exit = True
            return
        hold.model_loaded()

    state = make_state(engine_settings, server_settings, on_loaded)
    server = DrainingServer(serve_config(build_app(state), server_settings, sock), state, hold.listening)
    server.run(sockets=[sock])
    if outcome["exit_code"] == 0:
        log.info("server stopped")
    return outcome["exit_code"]


def serve_config(app: Any, settings: ServerSettings, sock: socket.socket | None = None) -> ServeConfig:
    """uvicorn's config with the connection limits (server/connections.py), logged with their reasons."""
    from moeserve.server.connections import (
        ConnectionLimits,
        ServeConfig,
        max_connections_choice,
        open_file_limit,
    )

    max_connections, why = max_connections_choice(settings.max_connections, open_file_limit(),
                                                  settings.max_concurrent_requests)
    log.info("connections: at most %d open (%s), %d requests in progress (max_concurrent_requests); a request's "
             "head within %g s (header_timeout_s, 16 KiB at most), its body within %g s (body_timeout_s, %g MB at "
             "most); idle keep-alive closed after %g s (timeout_keep_alive_s)", max_connections, why,
             settings.max_concurrent_requests, settings.header_timeout_s, settings.body_timeout_s,
             settings.max_request_body_mb, settings.timeout_keep_alive_s)
    host, port = (settings.host, settings.port) if sock is None else sock.getsockname()[:2]
    return ServeConfig(app, ConnectionLimits(max_connections, settings.header_timeout_s), host=host, port=port,
                       log_config=None, access_log=not settings.disable_log_requests,
                       timeout_keep_alive=math.ceil(settings.timeout_keep_alive_s),
                       timeout_graceful_shutdown=math.ceil(settings.shutdown_timeout))


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket for host:port, bound and listening now, before minutes of loading (handed to uvicorn).
    Raises ConfigError (one line) when another process holds the port or the address is not this machine's. Binds as
    uvicorn does (SO_REUSEADDR), so a restart does not wait for TIME_WAIT; of two servers started together, one
    gets the port and the other this error."""
    from moeserve.errors import ConfigError

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise ConfigError(f"cannot listen on {host}:{port}: {err.strerror} (check --host)") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(LISTEN_BACKLOG)
    except OSError as err:
        sock.close()
        why = "another process is listening there; stop it or choose another --port" \
            if err.errno == errno.EADDRINUSE else "check --host and --port"
        raise ConfigError(f"cannot listen on {host}:{port}: {err.strerror} ({why})") from None
    sock.set_inheritable(True)
    return sock


def _quiet_health_polls(record: logging.LogRecord) -> bool:
    """Drop uvicorn's access line of each GET /health: load balancers and the demo poll it every fraction of a
    second (hundreds of lines while a model loads). Every other request keeps its line."""
    args = record.args
    return not (isinstance(args, tuple) and len(args) >= 3 and args[1] == "GET"
                and str(args[2]).split("?")[0] == "/health")


class DrainingServer(uvicorn.Server):
    """uvicorn.Server that drains as documented: its signal handler marks the app as draining, and the socket stays
    open (new requests and /health get 503 `shutting_down`) until the requests in flight finish or
    shutdown_timeout passes; then uvicorn's own shutdown closes the socket and the connections. Accept errors
    (EMFILE) are logged once in a while, not a traceback each (server/connections.py)."""

    def __init__(self, config: uvicorn.Config, state: Any, listening: Callable[[str], None] = lambda url: None
                 ) -> None:
        super().__init__(config)
        self.state = state
        self.listening = listening

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        from moeserve.server.connections import EVICT_ON_EXHAUSTED, AcceptErrorLog, close_oldest_idle

        connections = self.server_state.connections
        asyncio.get_running_loop().set_exception_handler(
            AcceptErrorLog(on_exhausted=lambda: close_oldest_idle(connections, EVICT_ON_EXHAUSTED)))
        await super().startup(sockets)
        if self.should_exit or not self.servers:
            return
        host, port = self.servers[0].sockets[0].getsockname()[:2]  # the real port, when --port 0
        host = f"[{host}]" if ":" in host else host
        if sockets is not None:  # uvicorn says where it listens only for a socket it bound itself
            logging.getLogger("uvicorn.error").info("Uvicorn running on http://%s:%d (Press CTRL+C to quit)", host,
                                                    port)
        self.listening(f"http://{host}:{port}")

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timeout = float(self.state.settings.shutdown_timeout)
        deadline = time.monotonic() + timeout
        while self.state.engine.num_in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)  # still listening: new requests meanwhile get 503 shutting_down
        self.config.timeout_graceful_shutdown = max(1, math.ceil(deadline - time.monotonic()))
        await super().shutdown(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.state.draining:
            self.state.begin_drain()  # streams still open at the timeout end with an error event and [DONE]
            log.info("shutting down: no new requests; waiting up to %gs for %d in flight",
                     self.state.settings.shutdown_timeout, self.state.engine.num_in_flight)
        super().handle_exit(sig, frame)
        # uvicorn re-raises captured signals after shutdown (the process would die "by SIGTERM"); a completed
        # drain is a clean exit, so SIGTERM ends with status 0.
        self._captured_signals = [s for s in self._captured_signals if s != signal.SIGTERM]
