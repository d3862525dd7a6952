"""A server that holds under abuse (issue 36): each defect found by attacking a live loopback server, as a
regression test. One keyed server on the tiny model whose chat template turns hostile on cue: the key check comes
before the body, a deep body is a 400, errors hold no Python repr, request types are strict, a grammar that fails
mid-way is an error (never a normal stop), a template's time and output size are bounded; and the units under
them (the request-memory policy, the accept-error log, the tokenizer queue, the atomic bind, the key file).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from moeserve.bench.checkpoints import CHATML_TEMPLATE
from tests.server.conftest import MODEL_NAME, ThreadServer, engine_factory, make_state

KEY = "test-key-36"
AUTH = {"Authorization": f"Bearer {KEY}"}
TEMPLATE_TIMEOUT_S = 1.0
# The model's own ChatML template, unless the first message is "big" (a 2 GB string) or "slow" (10^10 loop steps).
HOSTILE_TEMPLATE = (
    "{% if messages[0]['content'] == 'big' %}{{ 'x' * 2000000000 }}"
    "{% elif messages[0]['content'] == 'slow' %}"
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{% else %}" + CHATML_TEMPLATE + "{% endif %}")


@pytest.fixture(scope="module")
def server(tiny_text_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadServer]:
    template = tmp_path_factory.mktemp("hostile") / "chat_template.jinja"
    template.write_text(HOSTILE_TEMPLATE)
    state = make_state(engine_factory(tiny_text_model, max_num_seqs=4, chat_template=str(template)), api_key=KEY,
                       template_timeout_s=TEMPLATE_TIMEOUT_S)
    live = ThreadServer(state, wait_ready=False)
    deadline = time.monotonic() + 600
    while httpx.get(live.url + "/health").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    yield live
    live.stop()


def post(server: ThreadServer, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, timeout=60,
                      headers={**AUTH, "content-type": "application/json", **kwargs.pop("headers", {})}, **kwargs)


# ------------------------------------------------------------------------------------------ 7. auth first
def test_without_the_key_a_malformed_body_is_401_not_400(server: ThreadServer) -> None:
    resp = post(server, "/v1/completions", b"{not json", headers={"Authorization": "Bearer wrong"})
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"


def test_without_the_key_the_body_is_not_read(server: ThreadServer) -> None:
    """A head announcing 14 MB and no body: a 401 comes back at once (a server reading the body would wait)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 14000000\r\n\r\n")
        answer = sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]


# ---------------------------------------------------------------------------------- 3. RecursionError
DEPTH = 100_000


@pytest.mark.parametrize("body", [
    "[" * DEPTH + '"\\ud800"' + "]" * DEPTH,  # the whole body, with a surrogate (the guard parses it)
    json.dumps({"prompt": "hi", "max_tokens": 1, "guided_json": "[" * DEPTH + "]" * DEPTH}),  # a field parsed later
], ids=["body", "schema-text"])
def test_a_body_nested_beyond_the_recursion_limit_is_400_without_traceback(
        server: ThreadServer, caplog: pytest.LogCaptureFixture, body: str) -> None:
    with caplog.at_level(logging.INFO):
        resp = post(server, "/v1/completions", body)
    assert resp.status_code == 400, resp.text[:300]
    assert "nests too deeply" in resp.json()["error"]["message"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


# ------------------------------------------------------------------------------------- 8. no Python repr
def test_a_validation_error_names_field_value_and_rule_without_python_repr(server: ThreadServer) -> None:
    resp = post(server, "/v1/completions", {"prompt": [1.5]})
    message = resp.json()["error"]["message"]
    assert resp.status_code == 400
    for internal in ("functools", "0x", "function-after", "<function", "validator"):
        assert internal not in message, message
    assert "prompt.0 (got 1.5)" in message and "valid integer" in message, message


# ---------------------------------------------------------------------------------------- 9. strict types
@pytest.mark.parametrize(("path", "body", "field", "rule"), [
    ("/v1/completions", {"prompt": "hi", "max_tokens": "4"}, "max_tokens", "valid integer"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream", "valid boolean"),
    ("/v1/completions", {"prompt": "hi", "logprobs": True}, "logprobs", "valid integer"),
    ("/v1/completions", {"prompt": "hi", "top_k": 1e30}, "top_k", "valid integer"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "min_tokens": 5}, "min_tokens", "at most max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2,
                              "min_tokens": 3}, "min_tokens", "at most max_completion_tokens"),
    ("/detokenize", {"tokens": ["1"]}, "tokens", "valid integer"),
])
def test_wrong_types_and_ranges_are_400_naming_field_and_rule(server: ThreadServer, path: str, body: dict[str, Any],
                                                              field: str, rule: str) -> None:
    resp = post(server, path, body)
    assert resp.status_code == 400, resp.text[:300]
    error = resp.json()["error"]
    assert field in error["message"] and rule in error["message"], error
    assert error["param"] is not None and error["param"].startswith(field), error


def test_top_k_beyond_the_vocabulary_is_400(server: ThreadServer) -> None:
    vocab = server.state.vocab_size
    assert vocab is not None
    assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "top_k": vocab}).status_code == 200
    resp = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "top_k": vocab + 1})
    assert resp.status_code == 400 and str(vocab) in resp.json()["error"]["message"]
    assert resp.json()["error"]["param"] == "top_k"


# ------------------------------------------------------------------------------------ 4. grammar failure
# the issue's: "a" may start, then the lexer gives up on the repetition (once answered 200, "a", "stop")
REGEX_BOMB = {"prompt": "a", "guided_regex": "a{1000000000}", "max_tokens": 12, "temperature": 0}
FAILS_MID_WAY = {**REGEX_BOMB, "guided_regex": "(a|b)c{1000000}"}  # a or b, then the lexer gives up on c{...}


@pytest.mark.parametrize("body", [REGEX_BOMB, FAILS_MID_WAY, {**REGEX_BOMB, "guided_regex": "ab{1000000000}"}],
                         ids=["issue-regex", "mid-way", "at-once"])
def test_a_grammar_that_fails_mid_way_is_an_error_not_a_stop(server: ThreadServer, body: dict[str, Any]) -> None:
    resp = post(server, "/v1/completions", body)
    assert resp.status_code == 400, resp.text[:300]
    error = resp.json()["error"]
    assert error["code"] == "constraint_failed" and "the output constraint failed" in error["message"], error


def test_a_streamed_grammar_failure_ends_with_an_error_event(server: ThreadServer) -> None:
    resp = post(server, "/v1/completions", {**FAILS_MID_WAY, "stream": True})
    assert resp.status_code == 200
    events = [json.loads(line[6:]) for line in resp.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    reasons = [c.get("finish_reason") for e in events for c in e.get("choices", [])]
    assert "stop" not in reasons and "length" not in reasons, events
    assert events[-1]["error"]["code"] == "constraint_failed", events[-1]
    assert resp.text.rstrip().endswith("data: [DONE]")


# --------------------------------------------------------------------------------------- 5. template limits
@pytest.mark.parametrize(("cue", "limit"), [("big", "template_max_output_mb"), ("slow", "template_timeout_s")])
def test_a_hostile_template_is_a_400_naming_the_limit(server: ThreadServer, cue: str, limit: str) -> None:
    t0 = time.monotonic()
    resp = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": cue}], "max_tokens": 1})
    took = time.monotonic() - t0
    assert resp.status_code == 400, resp.text[:300]
    assert limit in resp.json()["error"]["message"], resp.json()
    assert took < 30 * TEMPLATE_TIMEOUT_S  # a hang guard: the slow one would run for hours
    ok = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert ok.status_code == 200  # the tokenizer thread is free again


# ------------------------------------------------------------------------------------- units under them
def test_request_memory_admits_within_the_budget_and_refuses_beyond() -> None:
    from moeserve.server.request_memory import BYTES_PER_BODY_BYTE, MemoryRefused, RequestMemory

    body = 15_000_000
    memory = RequestMemory(budget_bytes=2 * RequestMemory.cost(body))
    charges = [memory.admit(body), memory.admit(body)]
    assert memory.held_bytes == sum(charges) <= memory.budget_bytes
    assert charges[0] >= BYTES_PER_BODY_BYTE * body
    with pytest.raises(MemoryRefused) as busy:
        memory.admit(body)
    assert not busy.value.never and "request_memory_mb" in str(busy.value)
    with pytest.raises(MemoryRefused) as never:
        memory.admit(3 * body)
    assert never.value.never
    memory.release(charges.pop())
    charges.append(memory.admit(body))  # room again once one is done
    for charge in charges:
        memory.release(charge)
    assert memory.held_bytes == 0 and memory.admitted == 0


def test_accept_errors_are_one_line_per_interval_without_traceback(caplog: pytest.LogCaptureFixture) -> None:
    from moeserve.server.connections import ACCEPT_LOG_EVERY_S, AcceptErrorLog

    now = [0.0]
    handler = AcceptErrorLog(clock=lambda: now[0])
    loop = asyncio.new_event_loop()
    try:
        with caplog.at_level(logging.WARNING):
            for _ in range(5000):  # 5000 failed accepts over 2.5 intervals
                handler(loop, {"message": "socket.accept() out of system resource",
                               "exception": OSError(24, "Too many open files")})
                now[0] += 2.5 * ACCEPT_LOG_EVERY_S / 5000
    finally:
        loop.close()
    lines = [r for r in caplog.records if "cannot accept" in r.getMessage()]
    assert 2 <= len(lines) <= 3 and not any(r.exc_info for r in caplog.records)
    assert "Too many open files" in lines[0].getMessage()


def test_two_servers_binding_one_port_at_once_one_wins() -> None:
    from moeserve.cli.serve import bind_socket
    from moeserve.errors import ConfigError

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    results: list[Any] = []
    start = threading.Barrier(2)

    def bind() -> None:
        start.wait()
        try:
            results.append(bind_socket("127.0.0.1", port))
        except ConfigError as err:
            results.append(err)

    threads = [threading.Thread(target=bind) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = [r for r in results if isinstance(r, socket.socket)]
    assert len(won) == 1 and "another process is listening" in str(next(r for r in results if r not in won))
    won[0].close()


def test_the_key_comes_from_a_file_or_the_environment(tmp_path: Path) -> None:
    from moeserve.config import ServerSettings, build_settings
    from moeserve.errors import ConfigError
    from moeserve.server.startup import with_key_from_file

    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    settings: ServerSettings = build_settings(ServerSettings, {"api_key_file": str(key_file)})
    assert with_key_from_file(settings).api_key == "s3cret"
    key_file.write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        with_key_from_file(settings)
    from_env: ServerSettings = build_settings(ServerSettings, {}, environ={"MOESERVE_API_KEY": "envkey"})
    assert from_env.api_key == "envkey"


def test_the_tokenizer_queue_is_bounded(tiny_text_model: Path) -> None:
    from moeserve.server.errors import APIError

    state = make_state(engine_factory(tiny_text_model), max_in_flight=2)
    release = threading.Event()

    async def scenario() -> None:
        held = [asyncio.ensure_future(state.off_loop(release.wait, 30)) for _ in range(2)]
        await asyncio.sleep(0.05)
        with pytest.raises(APIError) as busy:
            await state.off_loop(len, "x")
        assert busy.value.status == 503 and busy.value.code == "server_busy"
        release.set()
        await asyncio.gather(*held)
        assert await state.off_loop(len, "xy") == 2  # free again

    try:
        asyncio.run(scenario())
    finally:
        release.set()
        state.close()
    assert MODEL_NAME


def test_the_server_runs_on_asyncios_loop_even_where_uvloop_is_installed() -> None:
    """The EMFILE handling (AcceptErrorLog) hangs on asyncio's exception-handler call for a failed accept(), which
    uvloop does not make: with uvicorn's default loop ("auto": uvloop where installed, as Ray Serve's dependencies
    install it), /health never got in again under EMFILE (tests/server/test_abuse_load.py)."""
    from moeserve.server.connections import ConnectionLimits, ServeConfig

    config = ServeConfig(lambda *a: None, ConnectionLimits(8, 1.0), host="127.0.0.1", port=0)
    factory = config.get_loop_factory()
    loop = factory() if factory is not None else asyncio.new_event_loop()
    try:
        assert type(loop).__module__.startswith("asyncio"), type(loop)
    finally:
        loop.close()
