"""AsyncEngine: the narrow async interface between the HTTP server and the single-threaded LLMEngine.

    engine = AsyncEngine(lambda: LLMEngine(settings), max_in_flight=72)
    engine.start()                                   # loads the model in the background thread
    stream = engine.submit(prompt_ids, params, "cmpl-1")   # raises QueueFullError / EngineDeadError at once
    async for output in stream: ...                  # cumulative RequestOutputs until one is finished
    engine.abort("cmpl-1")                           # or just stop iterating: the stream aborts itself

One background thread owns the LLMEngine: it builds it, then loops apply commands (add, abort) -> step() ->
hand outputs to the asyncio side with `loop.call_soon_threadsafe`. Requests therefore join and leave the running
batch only at step boundaries. A MoeserveError raised by a step (an expert read error, say) fails only the
requests of that batch. Any other exception in the thread marks the engine dead: every open stream receives
EngineDeadError and `health()` says so, so the server answers 503 instead of hanging (the failure users report
as "health is 200 but nothing comes back").
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from moeserve.engine.logits_processor import FINISH_CONSTRAINT_FAILED, ConstraintFailedError
from moeserve.engine.outputs import RequestOutput
from moeserve.engine.sampling_params import SamplingParams
from moeserve.errors import MoeserveError
from moeserve.models.model import placement_stats

log = logging.getLogger("moeserve")


class EngineDeadError(MoeserveError):
    """The engine thread stopped (a crash, or shutdown); no request can be served any more."""


class EngineLoadingError(MoeserveError):
    """The model is still loading; retry shortly."""


class QueueFullError(MoeserveError):
    """More requests are in flight than max_num_seqs + max_queued_requests; retry later."""


class EngineLike(Protocol):
    """What AsyncEngine needs of an engine (LLMEngine, or a fake in tests)."""

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None) -> str: ...

    def abort_request(self, request_id: str) -> Any: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...


class State(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DEAD = "dead"


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class AsyncEngine:
    def __init__(self, make_engine: Callable[[], EngineLike], max_in_flight: int,
                 on_loaded: Callable[[BaseException | None], None] | None = None) -> None:
        """`make_engine` runs in the background thread (loading happens there, so the server can answer /health
        with 503 meanwhile). At most `max_in_flight` requests may be submitted and not finished at once."""
        self._make_engine = make_engine
        self.max_in_flight = max_in_flight
        self._on_loaded = on_loaded
        self.engine: Any = None
        self.state = State.LOADING
        self.error: BaseException | None = None
        self._cv = threading.Condition()
        self._commands: list[tuple[str, Any]] = []  # ("add", (prompt, params, id)) | ("abort", id)
        self._streams: dict[str, _Stream] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="moeserve-engine", daemon=True)
        # Published by the engine thread after each step: requests in the batch / waiting for a slot.
        self.num_running = 0
        self.num_waiting = 0

    # ----------------------------------------------------------------------------------- asyncio side
    def start(self) -> None:
        self._thread.start()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def check_ready(self) -> None:
        """Raise EngineLoadingError / EngineDeadError unless requests can be served now."""
        if self.state == State.LOADING:
            raise EngineLoadingError("the model is still loading; retry in a few seconds")
        if self.state == State.DEAD:
            raise EngineDeadError(f"the engine has stopped: {self.error}")

    def submit(self, prompt: str | list[int], params: SamplingParams,
               request_id: str) -> AsyncIterator[RequestOutput]:
        """Queue a request now (errors are raised here, before any response starts) and return its stream of
        cumulative outputs. Leaving the stream early (client gone, task cancelled) aborts the request."""
        self.check_ready()
        if len(self._streams) >= self.max_in_flight:
            raise QueueFullError(f"the server is busy ({len(self._streams)} requests in flight); retry later")
        if request_id in self._streams:
            raise MoeserveError(f"request id {request_id!r} is already in use")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._cv:
            self._streams[request_id] = stream
            self._commands.append(("add", (prompt, params, request_id)))
            self._cv.notify()
        return self._iterate(request_id, stream)

    async def _iterate(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine already dropped it
                    raise item
                if item.finished:
                    finished = True
                failed = next((c for c in item.outputs if c.finish_reason == FINISH_CONSTRAINT_FAILED), None)
                if failed is not None:  # not a normal finish: the stream raises (the request's other choices end)
                    raise ConstraintFailedError(str(failed.stop_reason), len(failed.token_ids))
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV slots at the next step boundary; later outputs for it are dropped."""
        with self._cv:
            if self._streams.pop(request_id, None) is None:
                return
            self._commands.append(("abort", request_id))
            self._cv.notify()

    def end_streams(self, err: MoeserveError) -> int:
        """End every open request now with `err` (its stream raises it) and abort it in the engine; the engine
        keeps running. Returns how many were ended (the server's shutdown timeout uses this)."""
        with self._cv:
            streams, self._streams = self._streams, {}
            self._commands.extend(("abort", request_id) for request_id in streams)
            self._cv.notify()
        for stream in streams.values():
            stream.put(err)
        return len(streams)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the thread (open streams get EngineDeadError) and release the engine's memory."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            self.engine = self._make_engine()
        except BaseException as err:
            # an on_loaded observer reports the error itself (the server's one `error:` line); else log it here
            self._die(err, None if self._on_loaded is not None else "loading the model failed")
            self._notify_loaded(err)
            return
        scan = getattr(self.engine, "start_reference_scan", None)  # LLMEngine: checksums of offloaded experts
        if scan is not None:
            scan()
        self.state = State.READY
        self._notify_loaded(None)
        try:
            self._loop()
        except BaseException as err:
            log.exception("engine thread crashed")
            self._die(err, "the engine crashed")
            return
        self._die(EngineDeadError("the server is shutting down"), None)
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()

    def _notify_loaded(self, err: BaseException | None) -> None:
        if self._on_loaded is not None:
            try:
                self._on_loaded(err)
            except Exception:  # a failing observer must not stop the engine thread before its loop
                log.exception("on_loaded callback failed")

    def _loop(self) -> None:
        engine = self.engine
        while True:
            with self._cv:
                while not (self._commands or self._stopping or engine.has_unfinished_requests()):
                    self._cv.wait()
                if self._stopping:
                    return
                commands, self._commands = self._commands, []
            for kind, arg in commands:
                self._apply(kind, arg)
            try:
                outputs = engine.step() if engine.has_unfinished_requests() else []
            except MoeserveError as err:
                # A user-level failure inside one step (an expert read error during a miss, say) fails the
                # requests of that batch; the store and KV cache stay consistent, so the engine goes on.
                self._fail_batch(err)
                outputs = []
            self._publish_load()  # before delivering: a client that saw its last token also sees the gauge drop
            self._deliver(outputs)

    def _apply(self, kind: str, arg: Any) -> None:
        if kind == "abort":
            self.engine.abort_request(arg)
            return
        prompt, params, request_id = arg
        with self._cv:
            stream = self._streams.get(request_id)
        if stream is None:  # aborted before it was added
            return
        try:
            self.engine.add_request(prompt, params, request_id)
        except MoeserveError as err:
            with self._cv:
                self._streams.pop(request_id, None)
            stream.put(err)

    def startup_choices(self) -> dict[str, str]:
        """The loaded engine's start-up choices by name, as logged (LLMEngine.choices); empty while loading."""
        return dict(getattr(self.engine, "choices", None) or {})

    def sequence_memory_stats(self) -> dict[str, float]:
        """The loaded engine's KV-block, preemption and prefix-cache figures; empty while loading."""
        stats = getattr(self.engine, "sequence_memory_stats", None)
        return stats() if stats is not None else {}

    def expert_store(self) -> Any:
        """The loaded engine's ExpertStore (its statistics for /metrics), or None while loading or without one."""
        model = getattr(self.engine, "model", None)
        return getattr(model, "store", None)

    def placement_stats(self) -> Any:
        """The hybrid placement's (PlacementStats, Costs) for /metrics, or None (loading, or no hybrid placement)."""
        model = getattr(self.engine, "model", None)
        return None if model is None or not hasattr(model, "moe_blocks") else placement_stats(model)

    def degraded(self) -> str | None:
        """None when healthy, else one line: the engine serves, but some requests fail (LLMEngine.health_problem)."""
        check = getattr(self.engine, "health_problem", None)
        return check() if check is not None else None

    def _fail_batch(self, err: MoeserveError) -> None:
        scheduler = getattr(self.engine, "scheduler", None)
        if scheduler is not None:
            ids = {seq.request_id for seq in scheduler.running}
        else:  # an engine without a visible batch: fail everything in flight
            with self._cv:
                ids = set(self._streams)
        log.error("a step failed; failing its %d request(s): %s", len(ids), err)
        for request_id in ids:
            self.engine.abort_request(request_id)
            with self._cv:
                stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.put(err)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        with self._cv:
            targets = []
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue  # aborted meanwhile: a late output is dropped
                if out.finished:
                    del self._streams[out.request_id]
                targets.append((stream, out))
        for stream, out in targets:
            stream.put(out.error if out.error is not None else out)  # a request that failed alone: its error

    def _publish_load(self) -> None:
        scheduler = getattr(self.engine, "scheduler", None)
        if scheduler is None:
            return
        self.num_running = len({s.request_id for s in scheduler.running})
        with self._cv:
            pending = sum(1 for kind, _ in self._commands if kind == "add")
        self.num_waiting = len({s.request_id for s in scheduler.waiting}) + pending

    def _die(self, err: BaseException, why: str | None) -> None:
        if why is not None:
            log.error("%s: %s", why, err)
        self.error = err
        self.state = State.DEAD
        self.num_running = self.num_waiting = 0
        with self._cv:
            streams, self._streams = list(self._streams.values()), {}
        dead = err if isinstance(err, EngineDeadError) else EngineDeadError(f"the engine has stopped: {err}")
        for stream in streams:
            stream.put(dead)
