"""schemathesis against /openapi.json on a live loopback server: no request the schema allows may cause a 5xx, and
every error leaves in the OpenAI shape.

Every operation of the schema, with a fixed seed (a failure replays). Half the cases with a JSON body get a lone
UTF-16 surrogate put into one of their strings (schemathesis, like hypothesis's text(), generates only valid
Unicode; a lone "\\ud800" in JSON gave 500s): those must be a 400 naming the surrogate. Then the same operations
with bodies and parameters that break the schema (schemathesis' negative mode: wrong JSON types, out-of-range
values, missing fields): each must be refused with a 4xx (`negative_data_rejection`: a string where an integer
belongs, "4" for max_tokens, was once accepted), never a Python repr in the error (slow tier); and, in the fast
tier, every integer, boolean and number field of every POST body given a value of another JSON type. A few examples
per operation in the fast tier; many more in the slow tier (CI runs both).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import negative_data_rejection, not_a_server_error

from tests.server.conftest import ThreadServer, engine_factory, make_state

SEED = 20_251_125
FAST_EXAMPLES = 5
SLOW_EXAMPLES = 120
NEGATIVE_SLOW_EXAMPLES = 10  # per POST operation: each case is a request the server must refuse
OPERATIONS = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{model_id}", "/v1/responses",
              "/v1/responses/{response_id}", "/v1/messages", "/v1/messages/count_tokens", "/health", "/metrics",
              "/tokenize", "/detokenize"}
# errors in Anthropic's shape: {"type": "error", "error": {"type", "message"}}
ANTHROPIC_PATHS = {"/v1/messages", "/v1/messages/count_tokens"}


@pytest.fixture(scope="module")
def fuzz_server(tiny_text_model: Path) -> Iterator[ThreadServer]:
    # A short context bounds the work any single fuzzed request can ask for.
    server = ThreadServer(make_state(engine_factory(tiny_text_model, max_model_len=48, max_num_seqs=4)))
    yield server
    server.stop()


def string_paths(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Paths to every string in a JSON value (dict keys included, as (..., key, None))."""
    if isinstance(value, str):
        yield path
    elif isinstance(value, dict):
        for key, item in value.items():
            yield (*path, key, None)
            yield from string_paths(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from string_paths(item, (*path, i))


def with_surrogate(body: Any, data: st.DataObject) -> Any | None:
    """A copy of `body` with a lone surrogate inserted into one of its strings; None when it has none."""
    paths = list(string_paths(body))
    if not paths:
        return None
    path = data.draw(st.sampled_from(paths))
    lone = data.draw(st.characters(categories=["Cs"]))  # U+D800..U+DFFF: never valid alone
    body = copy.deepcopy(body)
    if path and path[-1] is None:  # a key: rename it
        parent = body
        for step in path[:-2]:
            parent = parent[step]
        parent[path[-2] + lone] = parent.pop(path[-2])
        return body
    if not path:
        return body + lone
    parent = body
    for step in path[:-1]:
        parent = parent[step]
    text = parent[path[-1]]
    at = data.draw(st.integers(0, len(text)))
    parent[path[-1]] = text[:at] + lone + text[at:]
    return body


def fuzz(server: ThreadServer, examples: int) -> None:
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= OPERATIONS
    for operation in operations:

        @given(case=operation.as_strategy(), data=st.data())
        @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @seed(SEED)
        def check(case: Any, data: st.DataObject) -> None:
            mutated = None
            if isinstance(case.body, (dict, list, str)) and data.draw(st.booleans()):
                mutated = with_surrogate(case.body, data)
            if mutated is None:
                response = case.call(timeout=60)
            else:  # sent as JSON text with \uXXXX escapes (clients that encode to UTF-8 first cannot send this)
                response = httpx.request(case.method, server.url + case.path, params=case.query, timeout=60,
                                         content=json.dumps(mutated), headers={"content-type": "application/json"})
            where = (case.method, case.path, response.status_code, response.text[:500])
            assert response.status_code < 500, where
            if response.status_code >= 400:  # every error leaves in the OpenAI shape (Anthropic's on its paths)
                shape = {"type", "error"} if case.path in ANTHROPIC_PATHS else {"error"}
                assert set(response.json()) == shape, where
                assert set(response.json()["error"]) >= {"type", "message"}, where
            if mutated is not None:
                assert response.status_code == 400, where
                assert "lone UTF-16 surrogate" in response.json()["error"]["message"], where

        check()


def fuzz_wrong_types(server: ThreadServer, examples: int) -> None:
    """Negative mode: every case breaks the schema somewhere; each must be refused with a 4xx in the OpenAI shape."""
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    for operation in [result.ok() for result in schema.get_all_operations()]:
        if operation.method.upper() != "POST":  # GETs take only optional query flags: nothing to get wrong
            continue

        @given(case=operation.as_strategy(generation_mode=GenerationMode.NEGATIVE))
        @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @seed(SEED)
        def check(case: Any) -> None:
            response = case.call(base_url=server.url, timeout=60)
            case.validate_response(response, checks=[not_a_server_error, negative_data_rejection])
            text = response.text
            assert "0x" not in text and "functools" not in text, (case.path, text[:300])

        check()


# A valid body per POST operation (each answered 200): the base the type checks change one field of.
VALID_BODIES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"prompt": "hi", "max_tokens": 1},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    "/v1/responses": {"input": "hi", "max_output_tokens": 1},
    "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": "hi"}]},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [1]},
}
# what a lax parser would coerce to each JSON type: a string of a number or a truth value, a bool, a float
WRONG_VALUES = {"integer": ["4", True, 1.5], "boolean": ["yes", "true", 1], "number": ["0.5", True]}


def scalar_fields(spec: dict[str, Any], schema: dict[str, Any]) -> dict[str, str]:
    """name -> JSON type of each top-level integer, boolean or number field of a request body schema."""
    if "$ref" in schema:
        schema = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    out = {}
    for name, prop in schema.get("properties", {}).items():
        kinds = {alt.get("type") for alt in prop.get("anyOf", [prop])} - {"null"}
        if len(kinds) == 1 and next(iter(kinds)) in WRONG_VALUES:
            out[name] = next(iter(kinds))
    return out


def test_every_scalar_field_refuses_wrong_json_types(fuzz_server: ThreadServer) -> None:
    """Type conformance over the schema: each integer, boolean and number field of each POST body, given a value
    of another JSON type (a string "4", true for an integer), is a 400 naming the field, where the same body with
    its own value is a 200. Lax parsing once accepted "max_tokens": "4" and "stream": "yes"."""
    spec = httpx.get(fuzz_server.url + "/openapi.json").json()
    checked = 0
    for path, body in VALID_BODIES.items():
        assert httpx.post(fuzz_server.url + path, json=body, timeout=60).status_code == 200, path
        schema = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        for name, kind in scalar_fields(spec, schema).items():
            for wrong in WRONG_VALUES[kind]:
                resp = httpx.post(fuzz_server.url + path, json={**body, name: wrong}, timeout=60)
                where = (path, name, wrong, resp.status_code, resp.text[:300])
                assert resp.status_code == 400, where
                assert name in resp.text and "0x" not in resp.text, where
                checked += 1
    assert checked > 50  # every endpoint's fields, not a few


def test_no_server_errors(fuzz_server: ThreadServer) -> None:
    fuzz(fuzz_server, FAST_EXAMPLES)


@pytest.mark.slow
def test_no_server_errors_many_examples(fuzz_server: ThreadServer) -> None:
    fuzz(fuzz_server, SLOW_EXAMPLES)
    fuzz_wrong_types(fuzz_server, NEGATIVE_SLOW_EXAMPLES)


def test_with_surrogate_reaches_every_kind_of_string() -> None:
    body = {"a": "xy", "b": [{"c": "z"}], "d": 1}
    seen: set[str] = set()

    @given(data=st.data())
    @settings(max_examples=60, database=None)
    @seed(SEED)
    def check(data: st.DataObject) -> None:
        out = with_surrogate(body, data)
        assert out is not None and body == {"a": "xy", "b": [{"c": "z"}], "d": 1}  # the original is untouched
        changed = "key" if set(out) != set(body) or set(out["b"][0]) != {"c"} else \
            "a" if out["a"] != "xy" else "c" if out["b"][0]["c"] != "z" else "nothing"
        seen.add(changed)

    check()
    assert seen == {"a", "c", "key"}
