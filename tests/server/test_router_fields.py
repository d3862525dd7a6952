"""The vLLM/SGLang fields vLLM's router (vllm-router) writes into every request it forwards: accepted at their
neutral value (the same output as without them), each other value a one-line 400 naming the field and the value,
SGLang's structured-output names honoured as vLLM's, and a misspelt one still an unknown field."""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, ThreadServer

MESSAGES = [{"role": "user", "content": "Tell me about the weather"}]
GREEDY = {"model": MODEL_NAME, "temperature": 0, "max_tokens": 6}
# What vllm-router 0.1.17 (policy round_robin) forwarded for a plain request, read off a capturing upstream: these
# fields were added to the client's body.
ROUTER_CHAT = {"no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
               "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True,
               "return_hidden_states": False, "include_reasoning": True, "logprobs": False}
ROUTER_COMPLETION = {"echo": False, "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
                     "return_hidden_states": False}


def _post(server: ThreadServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def _chat(server: ThreadServer, **fields: Any) -> httpx.Response:
    return _post(server, "/v1/chat/completions", {**GREEDY, "messages": MESSAGES, **fields})


def _completion(server: ThreadServer, **fields: Any) -> httpx.Response:
    return _post(server, "/v1/completions", {**GREEDY, "prompt": "It is a truth", **fields})


def test_the_router_s_fields_at_their_neutral_values_change_nothing(live_server: ThreadServer) -> None:
    plain = _chat(live_server).json()["choices"][0]["message"]
    routed = _chat(live_server, **ROUTER_CHAT, session_params={"session_id": "user-7"})
    assert routed.status_code == 200, routed.text
    assert routed.json()["choices"][0]["message"] == plain
    plain_text = _completion(live_server).json()["choices"][0]["text"]
    routed = _completion(live_server, **ROUTER_COMPLETION)
    assert routed.status_code == 200, routed.text
    assert routed.json()["choices"][0]["text"] == plain_text


@pytest.mark.parametrize(("path", "field", "value"), [
    ("chat", "no_stop_trim", True), ("completion", "no_stop_trim", True),
    ("chat", "return_hidden_states", True), ("completion", "return_hidden_states", True),
    ("chat", "lora_path", "/adapters/a"), ("completion", "lora_path", "/adapters/a"),
    ("chat", "echo", True), ("completion", "echo", True),
    ("chat", "continue_final_message", True),
    ("chat", "separate_reasoning", False), ("chat", "stream_reasoning", False),
])
def test_a_value_that_asks_for_what_moeserve_does_not_do_is_named_in_a_400(
        live_server: ThreadServer, path: str, field: str, value: Any) -> None:
    reply = (_chat if path == "chat" else _completion)(live_server, **{field: value})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == field
    shown = {True: "true", False: "false"}.get(value, f'"{value}"')
    assert error["message"].startswith(f"{field}={shown} is not supported"), error["message"]
    assert "\n" not in error["message"]


def test_session_params_take_only_the_routing_key(live_server: ThreadServer) -> None:
    reply = _chat(live_server, session_params={"session_id": "s", "rid": "r1"})
    assert reply.status_code == 400
    assert reply.json()["error"]["message"].startswith("session_params.rid is not supported")


def test_sglang_structured_output_names_are_vllm_s(live_server: ThreadServer) -> None:
    pattern = "(yes|no), (red|blue)"
    by_regex = _chat(live_server, regex=pattern, max_tokens=20).json()["choices"][0]["message"]["content"]
    assert re.fullmatch(pattern, by_regex)
    assert by_regex == _chat(live_server, guided_regex=pattern, max_tokens=20).json()["choices"][0]["message"]["content"]
    grammar = 'root ::= "a" ("b" | "c")+'
    by_ebnf = _completion(live_server, ebnf=grammar, max_tokens=4).json()["choices"][0]["text"]
    assert re.fullmatch("a[bc]+", by_ebnf)
    assert by_ebnf == _completion(live_server, guided_grammar=grammar, max_tokens=4).json()["choices"][0]["text"]
    schema = '{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}'
    by_schema = _completion(live_server, json_schema=schema, max_tokens=12).json()["choices"][0]["text"]
    assert by_schema == _completion(live_server, guided_json=schema, max_tokens=12).json()["choices"][0]["text"]
    two = _chat(live_server, regex="a", guided_regex="b")
    assert two.status_code == 400 and "not several" in two.json()["error"]["message"]


def test_a_misspelt_router_field_is_still_unknown(live_server: ThreadServer) -> None:
    reply = _chat(live_server, no_stop_trm=False)
    assert reply.status_code == 400
    assert "did you mean 'no_stop_trim'" in reply.json()["error"]["message"]
