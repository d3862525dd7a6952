"""401, 503 (loading, queue full, engine dead), errors after a stream began, disconnects of non-streaming calls."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import MODEL_NAME, ThreadServer, engine_factory, make_state

LONG = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0,
        "ignore_eos": True}


def metric(url: str, name: str) -> float:
    """Sum of a metric's samples over its label sets (0 when it has none yet)."""
    lines = httpx.get(url + "/metrics").text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith(f"moeserve:{name}{{") or line.startswith(f"moeserve:{name} "))


def wait_until(check: Any, timeout: float = 600.0) -> bool:  # a hang guard: returns as soon as check() holds
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return False


class WrappedEngine:
    """The real engine, except that step() takes at least `step_s` seconds and raises after `steps_ok` steps."""

    def __init__(self, inner: Any, steps_ok: int | None = None, step_s: float = 0.0) -> None:
        self.inner, self.steps_ok, self.step_s = inner, steps_ok, step_s

    def step(self) -> Any:
        if self.steps_ok is not None:
            self.steps_ok -= 1
            if self.steps_ok < 0:
                raise RuntimeError("simulated device failure")
        time.sleep(self.step_s)
        return self.inner.step()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def slow_engine(model: Path, **settings: Any) -> Any:
    make = engine_factory(model, **settings)
    return lambda: WrappedEngine(make(), step_s=0.01)


def test_wrong_api_key_is_401(thread_server: Any, tiny_text_model: Path) -> None:
    server: ThreadServer = thread_server(make_state(engine_factory(tiny_text_model), api_key="s3cret"))
    with pytest.raises(openai.AuthenticationError) as info:
        server.client(api_key="wrong").models.list()
    body = info.value.response.json()
    assert body["error"]["code"] == "invalid_api_key" and set(body["error"]) == {"message", "type", "param", "code"}
    assert [m.id for m in server.client(api_key="s3cret").models.list().data] == [MODEL_NAME]
    assert httpx.get(server.url + "/health").status_code == 200  # probes need no key


def test_full_queue_is_503_with_retry_after(thread_server: Any, tiny_text_model: Path) -> None:
    server: ThreadServer = thread_server(make_state(slow_engine(tiny_text_model, max_num_seqs=1),
                                                    max_in_flight=1))
    with httpx.Client(timeout=30) as http, http.stream("POST", server.url + "/v1/completions",
                                                        json={**LONG, "stream": True}) as first:
        lines = first.iter_lines()  # keep the iterator: dropping it closes the connection
        next(lines)  # the first request is running
        with pytest.raises(openai.APIStatusError) as info:
            server.client().completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2)
        assert info.value.status_code == 503
        assert info.value.response.headers["retry-after"] == "1"
        assert info.value.response.json()["error"]["code"] == "server_busy"
    # Closing the stream aborted the request: the slot is free again.
    assert wait_until(lambda: metric(server.url, "num_requests_running") == 0)
    assert server.client().completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2).usage.total_tokens > 0
    assert metric(server.url, "request_rejected_total") == 1


def test_health_is_503_while_loading(thread_server: Any, tiny_text_model: Path) -> None:
    release = threading.Event()
    make = engine_factory(tiny_text_model)

    def slow_load() -> Any:
        release.wait(30)
        return make()

    server: ThreadServer = thread_server(make_state(slow_load), wait_ready=False)
    resp = httpx.get(server.url + "/health")
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "model_loading"
    busy = httpx.post(server.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi"})
    assert busy.status_code == 503 and "retry-after" in busy.headers
    release.set()
    assert wait_until(lambda: httpx.get(server.url + "/health").status_code == 200)


def test_engine_death_is_an_sse_error_and_health_503(thread_server: Any, tiny_text_model: Path) -> None:
    make = engine_factory(tiny_text_model)
    server: ThreadServer = thread_server(make_state(lambda: WrappedEngine(make(), steps_ok=5)))
    with httpx.Client(timeout=30) as http, http.stream("POST", server.url + "/v1/completions",
                                                        json={**LONG, "stream": True}) as resp:
        assert resp.status_code == 200
        events = [line.removeprefix("data: ") for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "engine_dead" and "simulated device failure" in error["message"]
    assert sum(1 for e in events[:-2] if json.loads(e)["choices"][0]["text"] is not None) >= 1
    health = httpx.get(server.url + "/health")
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
    after = httpx.post(server.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi"})
    assert after.status_code == 503  # answered at once, not left hanging


def test_non_streaming_disconnect_aborts_the_request(thread_server: Any, tiny_text_model: Path) -> None:
    server: ThreadServer = thread_server(make_state(slow_engine(tiny_text_model, max_num_seqs=2)))
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=LONG, timeout=0.5)
    assert wait_until(lambda: metric(server.url, "num_requests_running") == 0)
    assert metric(server.url, "request_success_total") == 0  # it never finished: it was aborted
    assert server.state.engine.num_in_flight == 0
    assert not server.state.llm.has_unfinished_requests()
    assert server.state.llm.memory.pools[0].num_used == 0  # every KV block came back


def test_draining_server_refuses_new_work(live_server: ThreadServer) -> None:
    live_server.state.draining = True
    try:
        health = httpx.get(live_server.url + "/health")
        work = httpx.post(live_server.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi"})
    finally:
        live_server.state.draining = False
    assert health.status_code == 503
    assert work.status_code == 503 and work.json()["error"]["code"] == "shutting_down"
    assert "retry-after" in work.headers


def test_unknown_fields_are_refused(live_server: ThreadServer) -> None:
    """A typo must not run silently (issue 20: `max_tokns` ran to the full context)."""
    resp = httpx.post(live_server.url + "/v1/completions",
                      json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 1, "best_of_luck": 3})
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == ("Unrecognized request argument supplied: 'best_of_luck' "
                                               "(did you mean 'best_of'?)")
