"""A mixed load for servers behind a router (Ray Serve, vllm-router): completions and chat, streamed or not, of
several lengths, some in a session; each request's greedy text, to compare with a single server's."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from tests.server.conftest import MODEL_NAME

SESSION_HEADER = "x-session-id"  # Ray Serve's session affinity header


def mixed_request(i: int) -> tuple[str, dict[str, Any], dict[str, str]]:
    """Request i of the mix: (path, body, headers)."""
    body: dict[str, Any] = {"model": MODEL_NAME, "temperature": 0, "max_tokens": 3 + i % 11, "stream": i % 3 == 0}
    headers = {SESSION_HEADER: f"session-{i % 4}"} if i % 2 else {}
    if i % 2:
        words = "Tell me about the weather in Bath. " * (1 + i % 5)
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": words}]}, headers
    return "/v1/completions", {**body, "prompt": "It is a truth universally acknowledged " * (1 + i % 4)}, headers


def _streamed_text(response: httpx.Response, chat: bool) -> str:
    parts = []
    for line in response.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[len("data: "):])
        if "error" in event:
            raise RuntimeError(f"error event: {event['error']}")
        for choice in event.get("choices", []):
            parts.append((choice.get("delta", {}).get("content") or "") if chat else choice.get("text", ""))
    return "".join(parts)


def send(url: str, i: int, timeout: float = 300) -> tuple[int, str]:
    """(status, greedy text, or the error body) of mixed request i against the server at `url`."""
    path, body, headers = mixed_request(i)
    chat = "chat" in path
    try:
        with httpx.stream("POST", url + path, json=body, headers=headers, timeout=timeout) as response:
            if response.status_code != 200:
                return response.status_code, response.read().decode()[:300]
            if body["stream"]:
                return 200, _streamed_text(response, chat)
            choice = json.loads(response.read())["choices"][0]
            return 200, choice["message"]["content"] if chat else choice["text"]
    except (httpx.HTTPError, RuntimeError, ValueError) as err:  # a cut stream, a refused connection
        return -1, f"{type(err).__name__}: {err}"


def send_all(url: str, count: int, workers: int = 6) -> list[tuple[int, str]]:
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda i: send(url, i), range(count)))
