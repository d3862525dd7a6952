"""Each engine under test lives in its own process, loaded once and driven over a pipe.

Separate processes keep the engines from sharing an allocator, threads or page cache accounting, and give each
its own peak RSS (VmHWM). The runner alternates calls between workers (A B A B) while the idle ones wait.
"""

from __future__ import annotations

import multiprocessing as mp
import traceback
from dataclasses import asdict
from multiprocessing.connection import Connection
from typing import Any

from moeserve.bench.memlimit import MemoryCgroup
from moeserve.errors import MoeserveError


class BenchWorkerError(MoeserveError):
    """An engine failed inside its worker process."""


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _serve(conn: Connection, engine_name: str, kwargs: dict[str, Any], cgroup: MemoryCgroup | None) -> None:
    import logging

    logging.basicConfig(level=logging.WARNING)
    try:
        if cgroup is not None:  # first: the engine's imports, weights and page cache are all charged there
            cgroup.join()
        from moeserve.bench.engines import ENGINE_CLASSES

        engine = ENGINE_CLASSES[engine_name](**kwargs)
        conn.send(("ok", {"peak_rss_bytes": peak_rss_bytes(), "name": engine.name,
                          "bytes_per_param": engine.bytes_per_param}))
    except Exception as err:  # noqa: BLE001 - reported to the parent, which decides
        conn.send(("error", f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=4)}"))
        return
    while True:
        msg = conn.recv()
        if msg[0] == "close":
            engine.close()
            conn.send(("ok", None))
            return
        try:
            method, args = msg
            timing = getattr(engine, method)(*args)
            result = asdict(timing)
            result["peak_rss_bytes"] = peak_rss_bytes()
            if cgroup is not None:  # RSS and page cache together, as the limit counts them
                result["cgroup_peak_bytes"] = cgroup.peak_bytes()
            conn.send(("ok", result))
        except Exception as err:  # noqa: BLE001
            conn.send(("error", f"{type(err).__name__}: {err}"))


class Worker:
    """A handle on one engine's process: `call("decode", prompts, n)` returns the Timing as a dict. With
    `cgroup`, the process runs inside that memory cgroup (its own: removed on close)."""

    def __init__(self, engine_name: str, cgroup: MemoryCgroup | None = None, **kwargs: Any) -> None:
        ctx = mp.get_context("spawn")
        self.cgroup = cgroup
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, engine_name, kwargs, cgroup), daemon=True)
        self.process.start()
        child.close()
        try:
            info = self._receive()
        except BaseException:
            self.close()  # the process is gone or going: remove its cgroup too
            raise
        self.name: str = info["name"]
        self.load_peak_rss_bytes: int = info["peak_rss_bytes"]
        # (dense, expert) weight bytes per parameter as the engine reports them from its file; None: by its name
        self.bytes_per_param: tuple[float, float] | None = info["bytes_per_param"]

    def _receive(self) -> Any:
        try:
            status, payload = self.conn.recv()
        except EOFError:
            self.process.join(5)
            hint = (f"killed over its memory limit of {self.cgroup.limit_bytes / 2**30:.1f} GiB? (--memory-limit-gb)"
                    if self.cgroup is not None else "check free memory")
            raise BenchWorkerError(f"benchmark worker died (exit code {self.process.exitcode}); {hint}") from None
        if status != "ok":
            raise BenchWorkerError(str(payload).splitlines()[0])
        return payload

    def call(self, method: str, *args: Any) -> dict[str, Any]:
        self.conn.send((method, args))
        return self._receive()

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send(("close",))
                self.conn.recv()
            except (EOFError, BrokenPipeError, OSError):
                pass
            self.process.join(30)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        if self.cgroup is not None:
            self.cgroup.remove()
