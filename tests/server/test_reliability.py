"""Reliability under abuse (issue 20): body-size limit, tokenization off the event loop, lone surrogates, stop
strings, one-line client-error logs, keep-alive after a 400, the shutdown cut, the API key on the docs."""

from __future__ import annotations

import http.client
import json
import logging
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from moeserve.config import ServerSettings, build_settings
from moeserve.errors import ConfigError
from moeserve.server.log_text import client_text
from tests.server.conftest import MODEL_NAME, REPO, ThreadServer, engine_factory, make_state
from tests.server.test_failures import wait_until

SMALL = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2, "temperature": 0}


def post(url: str, path: str, content: bytes | Iterator[bytes], **headers: str) -> httpx.Response:
    return httpx.post(url + path, content=content, headers={"content-type": "application/json", **headers},
                      timeout=60)


def is_openai_error(response: httpx.Response) -> bool:
    body = response.json()
    return set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}


# ------------------------------------------------------------------------------------------- body size limit
@pytest.fixture(scope="module")
def small_body_server(tiny_text_model: Path) -> Iterator[ThreadServer]:
    server = ThreadServer(make_state(engine_factory(tiny_text_model, max_num_seqs=4), max_request_body_mb=0.01))
    yield server
    server.stop()


def test_a_body_over_the_limit_is_413_by_content_length(small_body_server: ThreadServer) -> None:
    body = json.dumps({**SMALL, "prompt": "x" * 20_000}).encode()
    response = post(small_body_server.url, "/v1/completions", body)
    assert response.status_code == 413 and is_openai_error(response)
    assert "max_request_body_mb" in response.json()["error"]["message"]
    assert post(small_body_server.url, "/v1/completions", json.dumps(SMALL).encode()).status_code == 200


def test_a_chunked_body_is_cut_at_the_limit(small_body_server: ThreadServer) -> None:
    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it streams in
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(40):
            yield b"y" * 1000
        yield b'"}'

    response = post(small_body_server.url, "/tokenize", chunks())
    assert response.status_code == 413 and is_openai_error(response)

    def small_chunks() -> Iterator[bytes]:
        yield b'{"prompt": '
        yield b'"hello"}'

    assert post(small_body_server.url, "/tokenize", small_chunks()).status_code == 200


class GatedTokenizer:
    """The real tokenizer, except that encoding a text starting with BLOCK waits until released."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.entered, self.release = threading.Event(), threading.Event()

    def encode(self, text: str, *args: Any, **kwargs: Any) -> Any:
        if text.startswith("BLOCK"):
            self.entered.set()
            self.release.wait(120)
        return self.inner.encode(text, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_tokenizing_does_not_stall_the_event_loop(live_server: ThreadServer) -> None:
    llm = live_server.state.llm
    gate = GatedTokenizer(llm.tokenizer)
    llm.tokenizer = gate
    results: dict[str, int] = {}
    try:
        worker = threading.Thread(target=lambda: results.update(
            tokenize=httpx.post(live_server.url + "/tokenize", json={"prompt": "BLOCK me"}, timeout=120).status_code))
        worker.start()
        assert gate.entered.wait(60), "the tokenize request never reached the tokenizer"
        # The tokenizer is blocked now; on the event loop this would hang until the gate opens.
        assert httpx.get(live_server.url + "/health", timeout=30).status_code == 200
        assert httpx.get(live_server.url + "/v1/models", timeout=30).status_code == 200
    finally:
        gate.release.set()
        llm.tokenizer = gate.inner
    worker.join(60)
    assert results == {"tokenize": 200}


# ---------------------------------------------------------------------------------------- status codes
SURROGATE_BODIES = [
    ("/v1/completions", '{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"model": "tiny\\udfff", "prompt": "a", "max_tokens": 2}', "model"),
    ("/v1/chat/completions", '{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": '
     '"hi \\uD83D"}]}', "messages[0].content"),
    ("/v1/chat/completions", '{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": '
     '[{"type": "text", "text": "\\ud800"}]}]}', "messages[0].content[0].text"),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
    ("/tokenize", '{"messages": [{"role": "user", "content": "\\ude00x"}]}', "messages[0].content"),
    ("/tokenize", '{"prompt": "a", "\\ud800": 1}', "\\ud800"),
]


@pytest.mark.parametrize(("path", "body", "where"), SURROGATE_BODIES)
def test_a_lone_surrogate_is_a_400_naming_the_field(live_server: ThreadServer, path: str, body: str,
                                                   where: str) -> None:
    response = post(live_server.url, path, body.encode())
    assert response.status_code == 400, response.text
    assert is_openai_error(response)
    assert response.json()["error"]["message"].startswith(f"{where}: a lone UTF-16 surrogate")


def test_a_surrogate_encoded_as_utf8_bytes_is_a_400(live_server: ThreadServer) -> None:
    response = post(live_server.url, "/tokenize", b'{"prompt": "a\xed\xa0\x80"}')  # not UTF-8: not JSON
    assert response.status_code == 400 and is_openai_error(response)


def test_a_surrogate_pair_is_one_character(live_server: ThreadServer) -> None:
    response = post(live_server.url, "/tokenize", b'{"prompt": "\\ud83d\\ude00"}')
    assert response.status_code == 200
    assert response.json()["tokens"] == live_server.state.tokenizer.encode("\U0001f600")


def test_stop_strings(live_server: ThreadServer) -> None:
    long_stop = {**SMALL, "stop": "a stop string longer than sixteen characters"}
    assert httpx.post(live_server.url + "/v1/completions", json=long_stop, timeout=60).status_code == 200
    for stop in ("", [""], ["", "x"]):  # "" stops nothing: accepted, ignored
        response = httpx.post(live_server.url + "/v1/completions", json={**SMALL, "stop": stop}, timeout=60)
        assert response.status_code == 200, (stop, response.text)
    too_many = httpx.post(live_server.url + "/v1/completions", json={**SMALL, "stop": ["s"] * 17}, timeout=60)
    assert too_many.status_code == 400 and "stop" in too_many.json()["error"]["message"]


# ------------------------------------------------------------------------------------------------ logs
def test_client_errors_are_one_escaped_info_line(live_server: ThreadServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="moeserve")
    bad_name = "max_tokns\nERROR forged line" + "z" * 3000
    response = httpx.post(live_server.url + "/v1/completions", json={**SMALL, bad_name: 1}, timeout=60)
    assert response.status_code == 400
    lines = [r for r in caplog.records if r.name.startswith("moeserve") and "/v1/completions -> 400" in r.getMessage()]
    assert len(lines) == 1
    record = lines[0]
    assert record.levelno == logging.INFO and record.exc_info is None
    assert "\n" not in record.getMessage() and len(record.getMessage()) < 400
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_client_text() -> None:
    assert client_text("a\nb\ud800") == "a\\nb\\ud800"
    cut = client_text("x" * 1000, limit=10)
    assert cut == "xxxxxxxxxx... (1000 characters)"


def test_a_400_from_a_handler_keeps_the_connection(live_server: ThreadServer,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """A RequestError raised inside a handler (here: an image part in /tokenize) is a 400 on a connection that
    stays open, with no traceback logged."""
    caplog.set_level(logging.INFO)
    conn = http.client.HTTPConnection("127.0.0.1", live_server.port, timeout=60)
    body = json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})
    for _ in range(2):  # the second request goes over the same socket
        conn.request("POST", "/tokenize", body=body, headers={"content-type": "application/json"})
        response = conn.getresponse()
        assert response.status == 400
        assert "not supported" in json.loads(response.read())["error"]["message"]
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200
    conn.close()
    assert not [r for r in caplog.records if r.exc_info is not None]


def test_a_client_gone_before_its_answer_is_one_info_line(tiny_text_model: Path, thread_server: Any,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    from tests.server.test_failures import slow_engine

    caplog.set_level(logging.INFO)
    server = thread_server(make_state(slow_engine(tiny_text_model)))
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = json.dumps({**SMALL, "max_tokens": 400, "ignore_eos": True})
    conn.request("POST", "/v1/completions", body=body, headers={"content-type": "application/json"})
    assert wait_until(lambda: server.state.engine.num_in_flight == 1, 60)
    conn.close()
    assert wait_until(lambda: server.state.engine.num_in_flight == 0, 60)
    assert wait_until(lambda: any("client disconnected" in r.getMessage() for r in caplog.records), 60)
    gone = [r for r in caplog.records if "client disconnected" in r.getMessage()]
    assert gone[0].levelno == logging.INFO and gone[0].exc_info is None
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


# ------------------------------------------------------------------------------------ shutdown and API key
class StuckEngine:
    """Accepts requests and never finishes them (a generation longer than any shutdown timeout)."""

    max_model_len = 64
    tokenizer = None

    def __init__(self) -> None:
        self.requests: set[str] = set()
        self.tick = threading.Event()

    def add_request(self, prompt: Any, params: Any, request_id: str | None = None) -> str:
        self.requests.add(str(request_id))
        return str(request_id)

    def abort_request(self, request_id: str) -> None:
        self.requests.discard(request_id)

    def step(self) -> list[Any]:
        self.tick.wait(0.02)
        return []

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)


@pytest.mark.parametrize("stream", [True, False])
def test_the_shutdown_timeout_ends_open_requests_cleanly(thread_server: Any, stream: bool) -> None:
    server = thread_server(make_state(StuckEngine, shutdown_timeout=0.6))
    body = {"model": MODEL_NAME, "prompt": [1, 2, 3], "max_tokens": 8, "stream": stream}

    def drain_once_in_flight() -> None:
        if wait_until(lambda: server.state.engine.num_in_flight == 1, 60):
            server.state.begin_drain()  # as SIGTERM does (serve.DrainingServer)

    drainer = threading.Thread(target=drain_once_in_flight)
    drainer.start()
    with httpx.Client(timeout=60) as client, client.stream("POST", server.url + "/v1/completions", json=body) as r:
        text = r.read().decode()
    drainer.join()
    if stream:
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        assert r.status_code == 200 and events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "engine_dead"
        assert "shutdown timeout" in json.loads(events[-2])["error"]["message"]
    else:
        assert r.status_code == 503 and "shutdown timeout" in json.loads(text)["error"]["message"]
    assert server.state.engine.num_in_flight == 0
    assert httpx.get(server.url + "/health").status_code == 503  # draining


def test_an_empty_api_key_is_refused() -> None:
    for key in ("", "  "):
        with pytest.raises(ConfigError, match="empty API key"):
            build_settings(ServerSettings, {"api_key": key})
    # at start-up, in one line, before anything loads (`--api-key "$UNSET"` must not serve without a key)
    done = subprocess.run([sys.executable, "-m", "moeserve", "serve", "--api-key", "", "--port", "0"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode != 0 and len(lines) == 1 and "empty API key" in lines[0], lines


@pytest.mark.parametrize("path", ["/openapi.json", "/docs", "/redoc"])
def test_the_docs_need_the_key_when_one_is_set(thread_server: Any, path: str) -> None:
    server = thread_server(make_state(StuckEngine, api_key="sesame"))
    assert httpx.get(server.url + path).status_code == 401
    assert httpx.get(server.url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(server.url + path, headers={"Authorization": "Bearer sesame"}).status_code == 200
    open_server = thread_server(make_state(StuckEngine))
    assert httpx.get(open_server.url + path).status_code == 200


def test_sigterm_begins_the_drain_that_ends_open_streams() -> None:
    """serve's signal handler starts ServerState.begin_drain (the timer that ends open requests cleanly)."""
    import signal
    from types import SimpleNamespace

    import uvicorn

    from moeserve.cli.serve import DrainingServer

    class State:
        draining = False
        settings = SimpleNamespace(shutdown_timeout=1.0)
        engine = SimpleNamespace(num_in_flight=0)
        drains = 0

        def begin_drain(self) -> None:
            self.drains += 1
            self.draining = True

    state = State()
    server = DrainingServer(uvicorn.Config(app=lambda *_: None), state)
    server.handle_exit(signal.SIGTERM, None)
    server.handle_exit(signal.SIGTERM, None)
    assert state.drains == 1 and server.should_exit


def test_long_texts_encode_alike_through_the_gil_free_path(live_server: ThreadServer) -> None:
    """Tokenizer.encode takes encode_batch (which releases the GIL) from LONG_TEXT_CHARS on: the same ids."""
    from moeserve.tokenizer import LONG_TEXT_CHARS

    tokenizer = live_server.state.tokenizer
    text = ("Wörds, numbers 12345 and <|im_end|> tokens\n\t " * (LONG_TEXT_CHARS // 40 + 1))[: LONG_TEXT_CHARS + 7]
    for special in (True, False):
        assert tokenizer.encode(text, special) == list(tokenizer._tok.encode(text, add_special_tokens=special).ids)

