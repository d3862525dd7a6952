"""Error bodies name the field at fault in `param`, or none: a completions prompt too long says `prompt` (chat says
`messages`), a body that is not JSON names no field."""

from __future__ import annotations

import httpx

from tests.server.conftest import MODEL_NAME, ThreadServer


def test_a_prompt_too_long_names_the_field_that_holds_it(live_server: ThreadServer) -> None:
    limit = live_server.state.max_model_len
    tokens = [1] * limit
    completion = httpx.post(live_server.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": tokens})
    assert completion.status_code == 400
    error = completion.json()["error"]
    assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded")
    assert "your prompt has" in error["message"]
    long = httpx.post(live_server.url + "/v1/completions",
                      json={"model": MODEL_NAME, "prompt": [1] * 8, "max_tokens": limit}).json()["error"]
    assert long["param"] == "max_tokens" and "(8 in the prompt," in long["message"]
    chat = httpx.post(live_server.url + "/v1/chat/completions",
                      json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "x " * limit}]})
    assert chat.json()["error"]["param"] == "messages"


def test_a_body_that_is_not_json_names_no_field(live_server: ThreadServer) -> None:
    for body in ('{"model": "tiny",', "{bad", "null"):
        reply = httpx.post(live_server.url + "/v1/completions", content=body,
                           headers={"content-type": "application/json"})
        assert reply.status_code == 400
        error = reply.json()["error"]
        assert error["param"] is None, body
    assert "the body is not valid JSON" in httpx.post(
        live_server.url + "/v1/completions", content="{bad", headers={"content-type": "application/json"}
    ).json()["error"]["message"]
