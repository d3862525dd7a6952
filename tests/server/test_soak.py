"""A bounded soak (issue 20, slow tier): SOAK_REQUESTS mixed requests, CONCURRENCY at a time, against one `moeserve
serve` child process on the tiny model: greedy completions and chats (streamed and not), JSON-schema output,
streams dropped after their first event, requests abandoned right after sending, oversize bodies, bad input.

It must show: zero 5xx; every greedy answer that ran to the end equal to the same request run alone; every schema
answer valid; the RSS back within RSS_MARGIN_MIB of the baseline once idle. Bounded by the request count, never by
time; every wait is for a readiness signal (health, idle gauges).
"""

from __future__ import annotations

import json
import random
import socket
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import jsonschema
import pytest

from tests.server.conftest import MODEL_NAME, start_subprocess_server, wait_healthy
from tests.server.test_failures import wait_until
from tests.server.test_memory_return import rss_mib

SOAK_REQUESTS = 500
CONCURRENCY = 8
SEED = 7
RSS_MARGIN_MIB = 48  # over the baseline taken after one warm-up round of every kind (see the printed figures)
BODY_LIMIT_MB = 0.05
PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,",
           "In a hole in the ground there lived", "Roses are red,"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
BAD_BODIES = [
    b'{"model": "tiny", "prompt": "x", "max_tokns": 8}',  # unknown field
    b'{"model": "tiny", "prompt": "a\\ud800", "max_tokens": 2}',  # lone surrogate
    b'{"model": "tiny", "prompt": ',  # broken JSON
    b'{"model": "tiny", "prompt": "x", "max_tokens": 100000}',  # beyond the context
    b'{"model": "other", "prompt": "x"}',  # unknown model (404)
    b'{"model": "tiny", "prompt": [999999999]}',  # token id out of range
    b'{"model": "tiny", "prompt": "\xed\xa0\x80"}',  # a surrogate encoded as bytes: not UTF-8
]


def completion(i: int) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 16, "temperature": 0}


def chat(i: int) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            "max_tokens": 16, "temperature": 0}


def schema_chat(i: int) -> dict[str, Any]:
    return {**chat(i), "max_tokens": 60, "response_format": {
        "type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}}


# kind -> (path, body, streamed) for the requests whose answer is checked against its solo run
PLAIN: dict[str, tuple[str, Callable[[int], dict[str, Any]], bool]] = {
    "completion": ("/v1/completions", completion, False), "completion_stream": ("/v1/completions", completion, True),
    "chat": ("/v1/chat/completions", chat, False), "chat_stream": ("/v1/chat/completions", chat, True),
    "schema": ("/v1/chat/completions#schema", schema_chat, False),
    "schema_stream": ("/v1/chat/completions#schema", schema_chat, True),
}
KINDS = [*PLAIN, "dropped_stream", "abandoned", "oversize", "bad"]


def text_of(path: str, body: dict[str, Any]) -> str:
    """The answer's text from a non-streamed JSON body."""
    choice = body["choices"][0]
    return str(choice["text"] if path == "/v1/completions" else choice["message"]["content"])


def streamed_text(path: str, lines: list[str]) -> tuple[str, bool]:
    """(text, finished) from SSE lines: finished when a finish_reason came and [DONE] closed the stream."""
    events = [line[6:] for line in lines if line.startswith("data: ")]
    parts, finished = [], False
    for event in events:
        if event == "[DONE]":
            continue
        data = json.loads(event)
        assert "error" not in data, data
        for choice in data["choices"]:
            parts.append(choice.get("text") or "" if path == "/v1/completions" else
                         choice["delta"].get("content") or "")
            finished = finished or choice.get("finish_reason") is not None
    return "".join(parts), finished and events[-1] == "[DONE]"


class Soak:
    def __init__(self, url: str) -> None:
        self.url = url
        self.solo: dict[tuple[str, int], str] = {}
        self.statuses: Counter[int] = Counter()
        self.checked = Counter[str]()

    def solo_runs(self) -> None:
        with httpx.Client(timeout=600) as client:
            for i in range(len(PROMPTS)):
                for path, make in (("/v1/completions", completion), ("/v1/chat/completions", chat),
                                   ("/v1/chat/completions#schema", schema_chat)):
                    r = client.post(self.url + path.split("#")[0], json=make(i))
                    assert r.status_code == 200, r.text
                    self.solo[(path, i)] = text_of(path.split("#")[0], r.json())

    def plain(self, path: str, make: Callable[[int], dict[str, Any]], i: int, stream: bool) -> None:
        route = path.split("#")[0]
        with httpx.Client(timeout=600) as client:
            if not stream:
                r = client.post(self.url + route, json=make(i))
                self.statuses[r.status_code] += 1
                assert r.status_code == 200, r.text
                text = text_of(route, r.json())
            else:
                with client.stream("POST", self.url + route, json={**make(i), "stream": True}) as r:
                    self.statuses[r.status_code] += 1
                    text, finished = streamed_text(route, list(r.iter_lines()))
                assert finished
        assert text == self.solo[(path, i)], (path, i, stream)
        if path.endswith("#schema"):
            jsonschema.validate(json.loads(text), SCHEMA)
        self.checked[path + (" stream" if stream else "")] += 1

    def dropped_stream(self, i: int) -> None:
        with httpx.Client(timeout=600) as client, client.stream(
                "POST", self.url + "/v1/completions", json={**completion(i), "max_tokens": 40, "stream": True}) as r:
            self.statuses[r.status_code] += 1
            next(r.iter_lines())  # one event, then the client goes away

    def abandoned(self, i: int) -> None:
        """A whole request sent on a raw socket that is closed at once: the server may not even have read it."""
        where = urlparse(self.url)
        body = json.dumps({**chat(i), "max_tokens": 40}).encode()
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {where.hostname}\r\nContent-Type: application/json"
                f"\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        with socket.create_connection((where.hostname, where.port)) as sock:
            sock.sendall(head + body)

    def oversize(self, i: int) -> None:
        body = {**completion(i), "prompt": "x" * int(BODY_LIMIT_MB * 1e6 * 2)}
        r = httpx.post(self.url + "/v1/completions", json=body, timeout=600)
        self.statuses[r.status_code] += 1
        assert r.status_code == 413, r.text

    def bad(self, i: int) -> None:
        r = httpx.post(self.url + "/v1/completions", content=BAD_BODIES[i % len(BAD_BODIES)], timeout=600,
                       headers={"content-type": "application/json"})
        self.statuses[r.status_code] += 1
        assert r.status_code in (400, 404), r.text
        assert set(r.json()) == {"error"}

    def run(self, kind: str, i: int) -> None:
        if kind in PLAIN:
            path, make, stream = PLAIN[kind]
            self.plain(path, make, i, stream)
        else:
            getattr(self, kind)(i)

    def idle(self) -> bool:
        text = httpx.get(self.url + "/metrics", timeout=60).text
        gauges = [line for line in text.splitlines()
                  if line.startswith(("moeserve:num_requests_running", "moeserve:num_requests_waiting"))]
        return bool(gauges) and all(float(line.rsplit(" ", 1)[1]) == 0 for line in gauges)


@pytest.mark.slow
def test_soak(tiny_text_model: Path) -> None:
    proc, url = start_subprocess_server(tiny_text_model, "--max-num-seqs", "8", "--max-request-body-mb",
                                        str(BODY_LIMIT_MB))
    output: list[str] = []  # the server's log, read as it comes (a full pipe would block the server)
    reader = threading.Thread(target=lambda: output.extend(proc.stdout or []), daemon=True)
    reader.start()
    try:
        wait_healthy(url, timeout=600)
        soak = Soak(url)
        soak.solo_runs()
        for kind in KINDS:  # one round of every kind before the baseline
            for i in range(len(PROMPTS)):
                soak.run(kind, i)
        assert wait_until(soak.idle, 600)
        baseline = rss_mib(proc.pid)
        rng = random.Random(SEED)
        plan = [(rng.choice(KINDS), rng.randrange(len(PROMPTS))) for _ in range(SOAK_REQUESTS)]
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            for future in [pool.submit(soak.run, kind, i) for kind, i in plan]:
                future.result()
        assert wait_until(soak.idle, 600)
        assert httpx.get(url + "/health", timeout=60).status_code == 200
        after = rss_mib(proc.pid)
        print(f"\nsoak: {SOAK_REQUESTS} requests, statuses {dict(soak.statuses)}, checked equal to solo "
              f"{dict(soak.checked)}; RSS baseline {baseline:.0f} MiB, after {after:.0f} MiB "
              f"(+{after - baseline:.0f}, margin {RSS_MARGIN_MIB})")
        assert not [s for s in soak.statuses if s >= 500]
        assert after - baseline < RSS_MARGIN_MIB
    finally:
        proc.terminate()
        proc.wait(60)
        reader.join(60)
    log = "".join(output)
    assert "Traceback" not in log and "Exception in ASGI" not in log, log[-5000:]
    assert not [line for line in log.splitlines() if " ERROR " in line or line.startswith("ERROR")], log[-5000:]
