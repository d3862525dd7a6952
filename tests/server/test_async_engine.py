"""AsyncEngine with a fake engine: hand-off between threads, abort, queue limit, loading and dying."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from moeserve.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineLoadingError,
    QueueFullError,
    State,
)
from moeserve.engine.outputs import CompletionOutput, RequestOutput
from moeserve.engine.sampling_params import SamplingParams
from moeserve.errors import RequestError


class FakeEngine:
    """Generates token 100+i for step i; a request finishes after params.max_tokens tokens."""

    def __init__(self, fail_at_step: int | None = None) -> None:
        self.requests: dict[str, tuple[list[int], SamplingParams]] = {}
        self.aborted: list[str] = []
        self.steps = 0
        self.fail_at_step = fail_at_step

    def add_request(self, prompt: Any, params: SamplingParams, request_id: str | None = None) -> str:
        if prompt == []:
            raise RequestError("the prompt is empty", param="prompt")
        assert request_id is not None
        self.requests[request_id] = ([], params)
        return request_id

    def abort_request(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        if self.fail_at_step is not None and self.steps >= self.fail_at_step:
            raise RuntimeError("device lost")
        outputs = []
        for rid, (tokens, params) in list(self.requests.items()):
            tokens.append(100 + len(tokens))
            done = len(tokens) >= (params.max_tokens or 1)
            comp = CompletionOutput(0, "", list(tokens), None, None, "length" if done else None)
            outputs.append(RequestOutput(rid, None, [1], [comp], done))
            if done:
                del self.requests[rid]
        return outputs


def started(fake: FakeEngine, max_in_flight: int = 8) -> AsyncEngine:
    engine = AsyncEngine(lambda: fake, max_in_flight)
    engine.start()
    while engine.state == State.LOADING:
        time.sleep(0.001)
    return engine


async def collect(stream: Any) -> list[RequestOutput]:
    return [out async for out in stream]


def test_outputs_arrive_in_order_and_end_finished() -> None:
    engine = started(FakeEngine())

    async def main() -> list[list[RequestOutput]]:
        a = engine.submit([1, 2], SamplingParams(max_tokens=3), "a")
        b = engine.submit([3], SamplingParams(max_tokens=5), "b")
        return list(await asyncio.gather(collect(a), collect(b)))

    outs_a, outs_b = asyncio.run(main())
    assert [o.outputs[0].token_ids for o in outs_a] == [[100], [100, 101], [100, 101, 102]]
    assert outs_b[-1].finished and len(outs_b[-1].outputs[0].token_ids) == 5
    assert engine.num_in_flight == 0
    engine.shutdown()


def test_leaving_a_stream_aborts_the_request() -> None:
    fake = FakeEngine()
    engine = started(fake)

    async def main() -> None:
        stream = engine.submit([1], SamplingParams(max_tokens=10_000_000), "long")
        async for _ in stream:
            break
        await stream.aclose()  # type: ignore[attr-defined]
        for _ in range(200):
            if "long" in fake.aborted:
                return
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert fake.aborted == ["long"] and engine.num_in_flight == 0
    engine.shutdown()


def test_queue_limit_and_request_errors() -> None:
    engine = started(FakeEngine(), max_in_flight=1)

    async def main() -> None:
        stream = engine.submit([1], SamplingParams(max_tokens=10_000_000), "one")
        with pytest.raises(QueueFullError):
            engine.submit([1], SamplingParams(max_tokens=1), "two")
        engine.abort("one")
        await asyncio.sleep(0)
        with pytest.raises(RequestError):  # the engine's own rejection reaches the caller
            await collect(engine.submit([], SamplingParams(max_tokens=1), "empty"))
        del stream

    asyncio.run(main())
    engine.shutdown()


def test_a_crash_ends_every_stream_and_marks_the_engine_dead() -> None:
    engine = started(FakeEngine(fail_at_step=3))

    async def main() -> None:
        streams = [engine.submit([1], SamplingParams(max_tokens=100), f"r{i}") for i in range(3)]
        for stream in streams:
            with pytest.raises(EngineDeadError, match="device lost"):
                await collect(stream)
        with pytest.raises(EngineDeadError):
            engine.submit([1], SamplingParams(max_tokens=1), "late")

    asyncio.run(main())
    assert engine.state == State.DEAD


def test_loading_then_failed_load() -> None:
    gate = threading.Event()

    def load() -> FakeEngine:
        gate.wait(10)
        raise OSError("model.safetensors: no such file")

    loaded: list[BaseException | None] = []
    engine = AsyncEngine(load, 4, on_loaded=loaded.append)
    engine.start()
    with pytest.raises(EngineLoadingError):
        engine.check_ready()
    gate.set()
    engine._thread.join(10)
    assert engine.state == State.DEAD and isinstance(loaded[0], OSError)
    with pytest.raises(EngineDeadError, match="no such file"):
        engine.check_ready()


class FlakyStepEngine(FakeEngine):
    """Raises an ExpertLoadError on one step (a disk read error during a miss), then works again."""

    def step(self) -> list[RequestOutput]:
        from moeserve.errors import ExpertLoadError

        if self.steps == 1 and not getattr(self, "failed", False):  # the second step fails, once
            self.failed = True
            raise ExpertLoadError("model-00002.safetensors: read error in expert (3, 7)")
        return super().step()


def test_a_failed_step_fails_its_batch_and_the_engine_goes_on() -> None:
    from moeserve.errors import ExpertLoadError

    fake = FlakyStepEngine()
    engine = started(fake)

    async def first() -> None:
        with pytest.raises(ExpertLoadError, match="read error"):
            await collect(engine.submit([1], SamplingParams(max_tokens=5), "x"))

    asyncio.run(first())
    assert engine.state == State.READY and "x" in fake.aborted
    async def second() -> list[RequestOutput]:
        return await collect(engine.submit([1], SamplingParams(max_tokens=2), "y"))

    outs = asyncio.run(second())
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == [100, 101]
    engine.shutdown()
