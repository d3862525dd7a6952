"""The head and its expert workers, linked by torch.distributed's gloo backend (no transport of moeserve's own).

    link = connect_head("10.0.0.1:29600", workers=2, timeout_s=30)     # rank 0: binds that address only
    link = connect_worker("10.0.0.1:29600", timeout_s=30)              # ranks 1..N, in the order they join
    work = link.isend(tensor, to_rank, tag); link.wait(work, "sending layer 3 to rank 1")
    link.recv(tensor, from_rank, tag, "layer 3 from rank 1")            # an error after timeout_s, never a hang

Rendezvous is a TCPStore whose listening socket the head binds itself, on the named address only (torch's store
would listen on every interface); each rank's gloo device binds the address it reaches the head from. gloo has no
authentication: anyone who can reach these ports can join or feed the group (docs/expert-parallel.md). Every wait is
bounded by `timeout_s`; a peer that died closes its connections at once, one that hangs or is cut off is an error
when the wait runs out (`PeerLost`, which stops the engine: a step that lost a rank's experts cannot be retried).
"""

from __future__ import annotations

import datetime
import json
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from moeserve.errors import ConfigError

ANY_INTERFACE = ("0.0.0.0", "::", "")


class PeerLost(RuntimeError):
    """A rank did not answer within the timeout, or its connection closed: the group is gone. Not a MoeserveError:
    the engine does not contain it (every open request fails, /health answers 503)."""


def parse_address(address: str, flag: str) -> tuple[str, int]:
    """'host:port' -> (host, port); a one-line ConfigError naming `flag` otherwise."""
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{flag} {address!r}: expected HOST:PORT, e.g. 10.0.0.1:29600")
    return host, int(port)


def check_listen_address(host: str, any_interface: bool) -> None:
    """Refuse to listen on every interface unless asked (gloo has no authentication)."""
    if host in ANY_INTERFACE and not any_interface:
        raise ConfigError(f"--ep-listen {host or '(empty)'}: listens on every interface, and gloo has no "
                          "authentication; name one interface's address, or pass --ep-any-interface")


@dataclass
class Link:
    """This rank's gloo process group: `rank` 0 is the head, `size` ranks in all."""

    group: Any  # dist.ProcessGroupGloo
    rank: int
    size: int
    timeout_s: float
    store: Any  # the rendezvous store, kept open for the group's life

    @property
    def _timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Any:
        """Start sending `tensor` (contiguous) to `dst`; wait on the result with `wait`."""
        return self.group.send([tensor], dst, tag)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int) -> Any:
        return self.group.recv([tensor], src, tag)

    def wait(self, work: Any, what: str, timeout_s: float | None = None) -> None:
        """Wait for `work` within the timeout (None: this link's; 0: no limit, a worker idling for the next call);
        PeerLost naming `what` otherwise."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            if limit:
                work.wait(datetime.timedelta(seconds=limit))
            else:
                work.wait()
        except RuntimeError as err:
            reason = "no answer" if "Timed out" in str(err) else str(err).splitlines()[0]
            raise PeerLost(f"expert parallelism: {what}: {_short(reason)} (--ep-timeout {self.timeout_s:g} s)") \
                from None

    def recv(self, tensor: torch.Tensor, src: int, tag: int, what: str, timeout_s: float | None = None) -> None:
        self.wait(self.irecv(tensor, src, tag), what, timeout_s)

    def send(self, tensor: torch.Tensor, dst: int, tag: int, what: str) -> None:
        self.wait(self.isend(tensor, dst, tag), what)

    def send_json(self, obj: Any, dst: int, tag: int, what: str) -> None:
        """A JSON message: its length, then its UTF-8 bytes (never pickle: peers are not authenticated)."""
        data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
        self.send(torch.tensor([data.numel()], dtype=torch.int64), dst, tag, what)
        self.send(data, dst, tag, what)

    def recv_json(self, src: int, tag: int, what: str, timeout_s: float | None = None) -> Any:
        n = torch.zeros(1, dtype=torch.int64)
        self.recv(n, src, tag, what, timeout_s)
        if not 0 < int(n) <= 1 << 24:
            raise PeerLost(f"expert parallelism: {what}: a message of {int(n)} bytes (not a moeserve rank?)")
        data = torch.empty(int(n), dtype=torch.uint8)
        self.recv(data, src, tag, what, timeout_s)
        return json.loads(bytes(data.numpy()).decode())

    def close(self) -> None:
        """Drop the group (its connections close: peers waiting on this rank see it at once)."""
        self.group = self.store = None


def _short(reason: str) -> str:
    """gloo's message without its source location and its advice: 'Connection closed by peer [10.0.0.2]:41234'."""
    return reason.rsplit("] ", 1)[-1].split(". ", 1)[0].rstrip(".")[:200] if "] " in reason else reason[:200]


def connect_head(address: str, workers: int, timeout_s: float, any_interface: bool = False,
                 join_timeout_s: float = 300.0) -> Link:
    """Rank 0 of 1 + `workers` ranks: bind `address` (only), wait up to `join_timeout_s` for every worker to join."""
    host, port = parse_address(address, "--ep-listen")
    check_listen_address(host, any_interface)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ConfigError(f"--ep-listen {address}: cannot bind: {err.strerror}") from None
    sock.listen(64)
    timeout = datetime.timedelta(seconds=join_timeout_s)
    # the store owns the socket from here (detach: Python must not close it under the store's thread)
    store = dist.TCPStore(host, port, 1 + workers, True, timeout, wait_for_workers=False,
                          master_listen_fd=sock.detach(), use_libuv=False)
    return _join(store, 0, 1 + workers, host, timeout_s, join_timeout_s, f"waiting for {workers} expert worker(s) on {address}")


def connect_worker(address: str, timeout_s: float, join_timeout_s: float = 300.0) -> Link:
    """A worker: join the head at `address` (waiting up to `join_timeout_s` for it); its rank is the order it
    joined in (1, 2, ...)."""
    host, port = parse_address(address, "--head")
    timeout = datetime.timedelta(seconds=join_timeout_s)
    try:
        store = dist.TCPStore(host, port, None, False, timeout, use_libuv=False)
    except (RuntimeError, OSError) as err:
        raise ConfigError(f"--head {address}: cannot reach the head: {_short(str(err).splitlines()[0])}") from None
    size = int(store.get("moeserve/ep/size"))
    rank = int(store.add("moeserve/ep/joined", 1))
    if rank >= size:
        raise ConfigError(f"--head {address}: the head already has its {size - 1} worker(s)")
    return _join(store, rank, size, _local_address(host, port), timeout_s, join_timeout_s, f"joining the head at {address}")


def _join(store: Any, rank: int, size: int, bind_host: str, timeout_s: float, join_timeout_s: float,
          what: str) -> Link:
    if rank == 0:
        store.set("moeserve/ep/size", str(size))
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
    options._timeout = datetime.timedelta(seconds=join_timeout_s)
    try:
        group = dist.ProcessGroupGloo(store, rank, size, options)
    except RuntimeError as err:
        raise PeerLost(f"expert parallelism: {what}: {_short(str(err).splitlines()[0])}") from None
    return Link(group, rank, size, timeout_s, store)


def _local_address(host: str, port: int) -> str:
    """The address of the interface this machine reaches `host` from (a UDP connect sends nothing)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return str(s.getsockname()[0])
